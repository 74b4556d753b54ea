//! List filters in containerd's syntax, as `ctr snapshots ls` and containerd's garbage
//! collector send them: `field`, `field==value` and `field!=value`, joined by `,` (all must
//! hold); several filter strings match if any one does. Fields are `name`, `parent`, `kind`
//! and `labels.KEY`, where KEY may be double-quoted (`labels."containerd.io/gc.root"`).

use crate::error::SnapshotError;
use crate::model::Info;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Field {
    Name,
    Parent,
    Kind,
    Label(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Present,
    Eq(String),
    Ne(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Cond {
    field: Field,
    op: Op,
}

/// Any of several conjunctions; no filter at all matches everything.
#[derive(Debug, Default)]
pub struct Filter {
    any_of: Vec<Vec<Cond>>,
}

impl Filter {
    pub fn parse(filters: &[String]) -> Result<Filter, SnapshotError> {
        let mut any_of = Vec::new();
        for f in filters.iter().filter(|f| !f.trim().is_empty()) {
            any_of.push(parse_one(f).map_err(|why| SnapshotError::InvalidArgument(format!("filter {f:?}: {why}")))?);
        }
        Ok(Filter { any_of })
    }

    pub fn matches(&self, info: &Info) -> bool {
        self.any_of.is_empty() || self.any_of.iter().any(|all| all.iter().all(|c| c.holds(info)))
    }
}

impl Cond {
    fn holds(&self, info: &Info) -> bool {
        // As containerd's snapshot adaptor: name, parent and kind are always present (a base
        // layer's parent is ""), a label only when set. containerd finds a remote snapshot it
        // was told about with `parent==""` for a base layer.
        let value: Option<&str> = match &self.field {
            Field::Name => Some(&info.name),
            Field::Parent => Some(info.parent.as_deref().unwrap_or("")),
            Field::Kind => Some(info.kind.as_str()),
            Field::Label(k) => info.labels.get(k).map(String::as_str),
        };
        match &self.op {
            Op::Present => value.is_some(),
            Op::Eq(want) => value == Some(want.as_str()),
            Op::Ne(want) => value != Some(want.as_str()),
        }
    }
}

struct Lexer<'a> {
    rest: &'a str,
}

impl<'a> Lexer<'a> {
    fn skip_space(&mut self) {
        self.rest = self.rest.trim_start();
    }

    fn eat(&mut self, s: &str) -> bool {
        self.skip_space();
        match self.rest.strip_prefix(s) {
            Some(r) => {
                self.rest = r;
                true
            }
            None => false,
        }
    }

    /// A double-quoted string with backslash escapes, or a bare word up to `stop`.
    fn word(&mut self, stop: impl Fn(char) -> bool) -> Result<String, String> {
        self.skip_space();
        if let Some(body) = self.rest.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = body.char_indices();
            while let Some((i, c)) = chars.next() {
                match c {
                    '"' => {
                        self.rest = &body[i + 1..];
                        return Ok(out);
                    }
                    '\\' => match chars.next() {
                        Some((_, e)) => out.push(e),
                        None => break,
                    },
                    c => out.push(c),
                }
            }
            return Err("unterminated quoted string".into());
        }
        let end = self.rest.find(|c: char| stop(c) || c.is_whitespace()).unwrap_or(self.rest.len());
        if end == 0 {
            return Err(format!("expected a field or value at {:?}", self.rest));
        }
        let (w, r) = self.rest.split_at(end);
        self.rest = r;
        Ok(w.to_owned())
    }
}

fn parse_one(text: &str) -> Result<Vec<Cond>, String> {
    let mut lx = Lexer { rest: text };
    let mut conds = Vec::new();
    loop {
        let first = lx.word(|c| matches!(c, '.' | '=' | '!' | '~' | ','))?;
        let field = match first.as_str() {
            "name" => Field::Name,
            "parent" => Field::Parent,
            "kind" => Field::Kind,
            "labels" => {
                if !lx.eat(".") {
                    return Err("labels needs a key: labels.KEY".into());
                }
                Field::Label(lx.word(|c| matches!(c, '=' | '!' | '~' | ','))?)
            }
            other => return Err(format!("unknown field {other:?}: use name, parent, kind or labels.KEY")),
        };
        let op = if lx.eat("==") {
            Op::Eq(lx.word(|c| c == ',')?)
        } else if lx.eat("!=") {
            Op::Ne(lx.word(|c| c == ',')?)
        } else if lx.eat("~=") {
            return Err("regular-expression matches (~=) are not supported".into());
        } else {
            Op::Present
        };
        conds.push(Cond { field, op });
        lx.skip_space();
        if lx.rest.is_empty() {
            return Ok(conds);
        }
        if !lx.eat(",") {
            return Err(format!("expected ',' at {:?}", lx.rest));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Kind;
    use std::time::SystemTime;

    fn info(name: &str, kind: Kind, labels: &[(&str, &str)]) -> Info {
        Info {
            name: name.into(),
            parent: None,
            kind,
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            created: SystemTime::UNIX_EPOCH,
            updated: SystemTime::UNIX_EPOCH,
        }
    }

    fn f(s: &[&str]) -> Filter {
        Filter::parse(&s.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn containerd_filter_forms_match_as_containerd_means_them() {
        let a = info("a", Kind::Committed, &[("containerd.io/gc.root", "x")]);
        let b = info("b", Kind::Active, &[]);
        assert!(f(&[]).matches(&a));
        assert!(f(&["kind==committed"]).matches(&a) && !f(&["kind==committed"]).matches(&b));
        assert!(f(&[r#"labels."containerd.io/gc.root""#]).matches(&a));
        assert!(!f(&[r#"labels."containerd.io/gc.root""#]).matches(&b));
        assert!(f(&["kind==active", "name==a"]).matches(&a), "filters are alternatives");
        assert!(!f(&["kind==active,name==a"]).matches(&a), "commas join conditions");
        assert!(f(&[r#"name!="b""#]).matches(&a) && !f(&["name!=b"]).matches(&b));
        // containerd's lookup of a remote snapshot it was told about, for a base layer.
        let wanted = info("x", Kind::Committed, &[("containerd.io/snapshot.ref", "sha256:abc")]);
        assert!(f(&[r#"labels."containerd.io/snapshot.ref"==sha256:abc,parent=="""#]).matches(&wanted));
        assert!(!f(&[r#"labels."containerd.io/snapshot.ref"==sha256:abc,parent=="p""#]).matches(&wanted));
    }

    #[test]
    fn bad_filters_say_what_is_wrong() {
        for (bad, why) in [
            ("size==3", "unknown field"),
            ("labels", "labels needs a key"),
            ("name~=^a", "not supported"),
            ("name==\"a", "unterminated"),
            ("name==a name==b", "expected ','"),
        ] {
            let e = Filter::parse(&[bad.to_string()]).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
