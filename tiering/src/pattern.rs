//! Path patterns used by policy rules, pins, warm-up and eviction: a plain prefix, or a glob
//! where `*` stays within one path segment and `**` crosses segments.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone)]
pub enum PathPattern {
    Prefix(String),
    Glob(glob::Pattern),
    /// One path exactly; written `=path`.
    Exact(String),
}

const GLOB_OPTS: glob::MatchOptions =
    glob::MatchOptions { case_sensitive: true, require_literal_separator: true, require_literal_leading_dot: false };

impl PathPattern {
    /// Text with `*`, `?` or `[` is a glob; anything else is a prefix. A leading `/` is ignored,
    /// because object keys have none.
    pub fn parse(s: &str) -> Result<Self, String> {
        if let Some(exact) = s.strip_prefix('=') {
            return Ok(PathPattern::exact(exact));
        }
        let s = s.trim_start_matches('/');
        if s.contains(['*', '?', '[']) {
            glob::Pattern::new(s).map(PathPattern::Glob).map_err(|e| format!("glob `{s}` is invalid: {e}"))
        } else {
            Ok(PathPattern::Prefix(s.to_string()))
        }
    }

    pub fn prefix(s: &str) -> Self {
        PathPattern::Prefix(s.trim_start_matches('/').to_string())
    }

    pub fn exact(s: &str) -> Self {
        PathPattern::Exact(s.trim_start_matches('/').to_string())
    }

    pub fn glob(s: &str) -> Result<Self, String> {
        glob::Pattern::new(s.trim_start_matches('/'))
            .map(PathPattern::Glob)
            .map_err(|e| format!("glob `{s}` is invalid: {e}"))
    }

    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathPattern::Prefix(p) => path.starts_with(p.as_str()),
            PathPattern::Glob(g) => g.matches_with(path, GLOB_OPTS),
            PathPattern::Exact(p) => path == p,
        }
    }

    /// The literal part before any wildcard: what to LIST in the object store.
    pub fn list_prefix(&self) -> &str {
        match self {
            PathPattern::Prefix(p) | PathPattern::Exact(p) => p,
            PathPattern::Glob(g) => {
                let s = g.as_str();
                let end = s.find(['*', '?', '[']).unwrap_or(s.len());
                &s[..end]
            }
        }
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathPattern::Prefix(p) => f.write_str(p),
            PathPattern::Glob(g) => f.write_str(g.as_str()),
            PathPattern::Exact(p) => write!(f, "={p}"),
        }
    }
}

impl PartialEq for PathPattern {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl Serialize for PathPattern {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for PathPattern {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PathPattern::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_and_globs() {
        let p = PathPattern::parse("/datasets/imagenet/").unwrap();
        assert!(p.matches("datasets/imagenet/train/0001.jpg"));
        assert!(!p.matches("datasets/coco/x"));
        let e = PathPattern::parse("=ckpt/a.pt").unwrap();
        assert!(e.matches("ckpt/a.pt") && !e.matches("ckpt/a.pt.tmp"));
        assert_eq!(PathPattern::parse(&e.to_string()).unwrap(), e);
        let g = PathPattern::parse("ckpt/*/model.pt").unwrap();
        assert!(g.matches("ckpt/step100/model.pt"));
        assert!(!g.matches("ckpt/a/b/model.pt"));
        let gg = PathPattern::parse("ckpt/**/model.pt").unwrap();
        assert!(gg.matches("ckpt/a/b/model.pt"));
        assert_eq!(gg.list_prefix(), "ckpt/");
        assert!(PathPattern::parse("a/[").is_err());
    }
}
