//! The order a converted layer's entries are written in. Without a prefetch list, the layer
//! starts with `.no.prefetch.landmark` and keeps its order. With one, the listed files come
//! first in list order, each after its parent directories and its hard link's target, then
//! `.prefetch.landmark`, then everything else in its original order. Landmarks and TOCs that
//! the input already carries are dropped, as the format requires exactly one of each.

use super::tar_index::{Kind, TarEntry};
use crate::estargz::toc::{NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK, TOC_NAME};
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Item {
    Entry(usize),
    Landmark(&'static str),
}

/// One line of a prefetch list: a path, or a glob where `*` and `?` stay inside one path
/// component and `**` crosses them. A leading `/` or `./` is ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    glob: bool,
}

impl Pattern {
    pub fn parse(line: &str) -> Option<Pattern> {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            return None;
        }
        let t = t.trim_start_matches("./").trim_start_matches('/').trim_end_matches('/');
        Some(Pattern { text: t.to_owned(), glob: true })
    }

    /// A path matched as it is, even if it holds `*` or `?`: a recorded open.
    pub fn literal(path: &str) -> Pattern {
        Pattern { text: path.trim_start_matches('/').to_owned(), glob: false }
    }

    pub fn matches(&self, name: &str) -> bool {
        if self.glob { glob(self.text.as_bytes(), name.as_bytes()) } else { self.text == name }
    }
}

fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.first() {
        None => s.is_empty(),
        Some(b'*') if p.get(1) == Some(&b'*') => match p[2..].strip_prefix(b"/") {
            // `**/` is any number of whole directories, none included.
            Some(rest) => (0..=s.len()).any(|i| (i == 0 || s[i - 1] == b'/') && glob(rest, &s[i..])),
            None => (0..=s.len()).any(|i| glob(&p[2..], &s[i..])),
        },
        Some(b'*') => (0..=s.len()).take_while(|i| *i == 0 || s[i - 1] != b'/').any(|i| glob(&p[1..], &s[i..])),
        Some(b'?') => s.first().is_some_and(|c| *c != b'/') && glob(&p[1..], &s[1..]),
        Some(c) => s.first() == Some(c) && glob(&p[1..], &s[1..]),
    }
}

fn dropped(name: &str) -> bool {
    matches!(name, TOC_NAME | PREFETCH_LANDMARK | NO_PREFETCH_LANDMARK)
}

/// The write order of `entries` for `prefetch`, and how many entries precede the landmark.
pub fn plan(entries: &[TarEntry], prefetch: &[Pattern]) -> (Vec<Item>, usize) {
    let kept: Vec<usize> = (0..entries.len()).filter(|i| !dropped(&entries[*i].name)).collect();
    // The last entry of a name is the one that counts, as in an unpack.
    let by_name: HashMap<&str, usize> = kept.iter().map(|i| (entries[*i].name.as_str(), *i)).collect();
    let mut moved = vec![false; entries.len()];
    let mut first = Vec::new();
    fn take(
        i: usize,
        entries: &[TarEntry],
        by_name: &HashMap<&str, usize>,
        moved: &mut [bool],
        first: &mut Vec<usize>,
    ) {
        if moved[i] {
            return;
        }
        moved[i] = true;
        let name = &entries[i].name;
        let mut parent = name.as_str();
        let mut parents = Vec::new();
        while let Some((p, _)) = parent.rsplit_once('/') {
            parents.push(p);
            parent = p;
        }
        for p in parents.into_iter().rev() {
            if let Some(&d) = by_name.get(p) {
                take(d, entries, by_name, moved, first);
            }
        }
        if let Kind::Hardlink(target) = &entries[i].kind
            && let Some(&t) = by_name.get(target.as_str())
        {
            take(t, entries, by_name, moved, first);
        }
        first.push(i);
    }
    for pattern in prefetch {
        for &i in &kept {
            if entries[i].kind != Kind::Dir && pattern.matches(&entries[i].name) {
                take(i, entries, &by_name, &mut moved, &mut first);
            }
        }
    }
    if first.is_empty() {
        let mut order = vec![Item::Landmark(NO_PREFETCH_LANDMARK)];
        order.extend(kept.into_iter().map(Item::Entry));
        return (order, 0);
    }
    let count = first.len();
    let mut order: Vec<Item> = first.into_iter().map(Item::Entry).collect();
    order.push(Item::Landmark(PREFETCH_LANDMARK));
    order.extend(kept.into_iter().filter(|i| !moved[*i]).map(Item::Entry));
    (order, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(name: &str, kind: Kind) -> TarEntry {
        TarEntry {
            name: name.into(),
            kind,
            start: 0,
            data: 0,
            size: 0,
            end: 0,
            mode: 0,
            uid: 0,
            gid: 0,
            user_name: String::new(),
            group_name: String::new(),
            mtime: 0,
            xattrs: Default::default(),
        }
    }

    #[test]
    fn globs_stay_in_components_unless_doubled() {
        let p = |s: &str| Pattern::parse(s).unwrap();
        assert!(p("/usr/bin/python3").matches("usr/bin/python3"));
        assert!(p("usr/lib/*.so").matches("usr/lib/a.so"));
        assert!(!p("usr/lib/*.so").matches("usr/lib/x/a.so"));
        assert!(p("usr/lib/**/*.py").matches("usr/lib/python3/json/__init__.py"));
        assert!(p("usr/lib/**/*.py").matches("usr/lib/a.py"));
        assert!(p("usr/**").matches("usr/a/b"));
        assert!(p("a?c").matches("abc") && !p("a?c").matches("a/c"));
        assert_eq!(Pattern::parse("  # comment"), None);
        assert!(Pattern::literal("/a*b").matches("a*b") && !Pattern::literal("a*b").matches("axb"));
    }

    #[test]
    fn listed_files_come_first_with_parents_and_link_targets_then_the_landmark() {
        let entries = vec![
            e("etc", Kind::Dir),
            e("etc/motd", Kind::Reg),
            e("usr", Kind::Dir),
            e("usr/bin", Kind::Dir),
            e("usr/bin/python3.11", Kind::Reg),
            e("usr/bin/python3", Kind::Hardlink("usr/bin/python3.11".into())),
            e(".prefetch.landmark", Kind::Reg),
            e("stargz.index.json", Kind::Reg),
        ];
        let (order, n) = plan(&entries, &[Pattern::parse("/usr/bin/python3").unwrap()]);
        use Item::*;
        assert_eq!(order, [Entry(2), Entry(3), Entry(4), Entry(5), Landmark(PREFETCH_LANDMARK), Entry(0), Entry(1)]);
        assert_eq!(n, 4);
        let (order, n) = plan(&entries, &[Pattern::parse("/nothing/here").unwrap()]);
        assert_eq!(order[0], Landmark(NO_PREFETCH_LANDMARK));
        assert_eq!(order.len(), 7);
        assert_eq!(n, 0);
    }
}
