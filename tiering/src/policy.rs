//! The tiering policy: one TOML document with defaults and rules matched by path prefix or glob.
//!
//! ```toml
//! eviction = "lru"        # lru | lfu | lrfu
//! hot_idle = "7d"         # demote hot -> warm after this long without access
//! warm_idle = "30d"       # evict from warm after this long without access (unset: never)
//!
//! [[rule]]
//! prefix = "checkpoints/"
//! pin = "hot"
//! ```
//!
//! The first rule that matches a path decides every field it sets; fields it leaves out come
//! from the defaults.

use crate::pattern::PathPattern;
use crate::tier::TierKind;
use crate::units::Dur;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Which entries leave a tier first when it passes its high watermark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Eviction {
    /// Least recently used.
    #[default]
    Lru,
    /// Least frequently used; ties broken by recency.
    Lfu,
    /// Least recently/frequently used: a recency-weighted access count (half-life `lrfu_half_life`).
    Lrfu,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    #[serde(default)]
    pub eviction: Eviction,
    #[serde(default = "default_hot_idle")]
    pub hot_idle: Dur,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_idle: Option<Dur>,
    #[serde(default = "default_half_life")]
    pub lrfu_half_life: Dur,
    #[serde(default, rename = "rule", skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<Rule>,
}

fn default_hot_idle() -> Dur {
    Dur::secs(7 * 86400)
}
fn default_half_life() -> Dur {
    Dur::secs(3600)
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            eviction: Eviction::Lru,
            hot_idle: default_hot_idle(),
            warm_idle: None,
            lrfu_half_life: default_half_life(),
            rules: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glob: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin: Option<TierKind>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_cache: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<Dur>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_idle: Option<Dur>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_idle: Option<Dur>,
    #[serde(skip)]
    pub(crate) matcher: Option<PathPattern>,
}

impl Rule {
    /// A rule for every path under `prefix`, as a mount's own settings make one (a CSI
    /// volume's `pin` or `noCache`); the policy's `validate` compiles it.
    pub fn for_prefix(prefix: &str, pin: Option<TierKind>, no_cache: bool) -> Rule {
        Rule {
            prefix: Some(prefix.to_owned()),
            glob: None,
            pin,
            no_cache,
            ttl: None,
            hot_idle: None,
            warm_idle: None,
            matcher: None,
        }
    }
}

/// A policy file that could not be accepted. `key` names the offending setting, e.g. `rule[1].ttl`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{key}: {message}")]
pub struct PolicyError {
    pub key: String,
    pub message: String,
}

/// What the policy says about one path.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub pin: Option<TierKind>,
    pub no_cache: bool,
    pub ttl: Option<Duration>,
    pub hot_idle: Duration,
    pub warm_idle: Option<Duration>,
}

impl Policy {
    /// Parses and validates a policy document.
    pub fn from_toml(text: &str) -> Result<Policy, PolicyError> {
        let de = toml::Deserializer::parse(text)
            .map_err(|e| PolicyError { key: "policy".into(), message: e.message().to_string() })?;
        let mut policy: Policy = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            PolicyError {
                key: if key == "." { "policy".into() } else { key },
                message: e.inner().message().to_string(),
            }
        })?;
        policy.validate()?;
        Ok(policy)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a policy always serialises")
    }

    /// Checks cross-field rules and compiles the matchers.
    pub fn validate(&mut self) -> Result<(), PolicyError> {
        for (i, r) in self.rules.iter_mut().enumerate() {
            let err = |field: &str, message: String| PolicyError { key: format!("rule[{i}]{field}"), message };
            r.matcher = Some(match (&r.prefix, &r.glob) {
                (Some(p), None) => PathPattern::prefix(p),
                (None, Some(g)) => PathPattern::glob(g).map_err(|m| err(".glob", m))?,
                _ => return Err(err("", "set exactly one of `prefix` or `glob`".into())),
            });
            if r.no_cache && r.pin.is_some() {
                return Err(err(".pin", "a rule cannot both pin and set `no_cache`".into()));
            }
        }
        Ok(())
    }

    /// Checks the rules against the tiers there are: a pin to a warm tier that is not
    /// configured would be accepted and then not kept (its chunks evicted from hot).
    pub fn check_tiers(&self, warm: bool) -> Result<(), PolicyError> {
        for (i, r) in self.rules.iter().enumerate() {
            if r.pin == Some(TierKind::Warm) && !warm {
                return Err(PolicyError {
                    key: format!("rule[{i}].pin"),
                    message: "the warm tier is not configured: pin to hot, or configure a warm tier".into(),
                });
            }
        }
        Ok(())
    }

    pub fn resolve(&self, path: &str) -> Resolved {
        let rule = self.rules.iter().find(|r| r.matcher.as_ref().is_some_and(|m| m.matches(path)));
        Resolved {
            pin: rule.and_then(|r| r.pin),
            no_cache: rule.is_some_and(|r| r.no_cache),
            ttl: rule.and_then(|r| r.ttl).map(|d| d.0),
            hot_idle: rule.and_then(|r| r.hot_idle).unwrap_or(self.hot_idle).0,
            warm_idle: rule.and_then(|r| r.warm_idle).or(self.warm_idle).map(|d| d.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_demote_hot_after_seven_days() {
        let p = Policy::from_toml("").unwrap();
        let r = p.resolve("anything");
        assert_eq!(r.hot_idle, Duration::from_secs(7 * 86400));
        assert_eq!(r.warm_idle, None);
        assert_eq!(r.pin, None);
        assert_eq!(p.eviction, Eviction::Lru);
    }

    #[test]
    fn first_matching_rule_wins() {
        let p = Policy::from_toml(
            r#"
            eviction = "lfu"
            warm_idle = "30d"
            [[rule]]
            glob = "ckpt/**/latest/*"
            pin = "hot"
            [[rule]]
            prefix = "ckpt/"
            ttl = "1h"
            hot_idle = "1d"
            [[rule]]
            prefix = "scratch/"
            no_cache = true
            "#,
        )
        .unwrap();
        assert_eq!(p.resolve("ckpt/run1/latest/model.pt").pin, Some(TierKind::Hot));
        let r = p.resolve("ckpt/run1/step1/model.pt");
        assert_eq!(r.pin, None);
        assert_eq!(r.ttl, Some(Duration::from_secs(3600)));
        assert_eq!(r.hot_idle, Duration::from_secs(86400));
        assert_eq!(r.warm_idle, Some(Duration::from_secs(30 * 86400)));
        assert!(p.resolve("scratch/x").no_cache);
        let again = Policy::from_toml(&p.to_toml()).unwrap();
        assert_eq!(again.rules.len(), 3);
        assert_eq!(again.eviction, Eviction::Lfu);
    }

    #[test]
    fn a_pin_to_a_warm_tier_that_is_not_there_is_refused() {
        let p =
            Policy::from_toml("[[rule]]\nprefix = \"a/\"\npin = \"hot\"\n[[rule]]\nprefix = \"b/\"\npin = \"warm\"\n")
                .unwrap();
        assert!(p.check_tiers(true).is_ok());
        let e = p.check_tiers(false).unwrap_err();
        assert_eq!(e.key, "rule[1].pin");
        assert!(e.message.contains("warm tier is not configured"), "{e}");
    }

    #[test]
    fn errors_name_the_key() {
        let e = Policy::from_toml("hot_idel = \"1d\"").unwrap_err();
        assert!(e.to_string().contains("hot_idel"), "{e}");
        let e = Policy::from_toml("[[rule]]\nprefix = \"a\"\nttl = \"soon\"").unwrap_err();
        assert_eq!(e.key, "rule[0].ttl", "{e}");
        let e = Policy::from_toml("[[rule]]\nprefix = \"a\"\npin = \"cold\"").unwrap_err();
        assert_eq!(e.key, "rule[0].pin", "{e}");
        let e = Policy::from_toml("[[rule]]\nttl = \"1h\"").unwrap_err();
        assert_eq!(e.key, "rule[0]", "{e}");
        let e = Policy::from_toml("eviction = \"fifo\"").unwrap_err();
        assert_eq!(e.key, "eviction", "{e}");
        let e = Policy::from_toml("[[rule]]\nprefix = \"a\"\npin = \"hot\"\nno_cache = true").unwrap_err();
        assert_eq!(e.key, "rule[0].pin");
    }
}
