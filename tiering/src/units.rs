//! Human-readable sizes ("64GiB", "512MB", 1048576) and durations ("7d", "90s")
//! as they appear in config and policy files.

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};
use std::fmt;
use std::time::Duration;

/// A byte count. Accepts an integer or a string with a unit (B, KB, KiB, MB, MiB, GB, GiB, TB, TiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const fn mib(n: u64) -> Self {
        ByteSize(n << 20)
    }
    pub const fn gib(n: u64) -> Self {
        ByteSize(n << 30)
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.starts_with('-') {
            return Err(format!("size `{s}` must not be negative"));
        }
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let unit = unit.trim();
        let mult: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1000,
            "kib" => 1 << 10,
            "m" | "mb" => 1000 * 1000,
            "mib" => 1 << 20,
            "g" | "gb" => 1000 * 1000 * 1000,
            "gib" => 1 << 30,
            "t" | "tb" => 1000u64.pow(4),
            "tib" => 1 << 40,
            _ => {
                return Err(format!(
                    "size `{s}` has an unknown unit `{unit}` (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
                ));
            }
        };
        let value: f64 =
            num.parse().map_err(|_| format!("size `{s}` is not a number with an optional unit, e.g. `64GiB`"))?;
        let bytes = value * mult as f64;
        if !bytes.is_finite() || bytes > u64::MAX as f64 {
            return Err(format!("size `{s}` is too large"));
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
        for (name, m) in UNITS {
            if self.0 >= m {
                let v = self.0 as f64 / m as f64;
                return if self.0.is_multiple_of(m) {
                    write!(f, "{}{name}", self.0 / m)
                } else {
                    write!(f, "{v:.1}{name}")
                };
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as 1048576 or \"64GiB\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| E::custom(format!("size {v} must not be negative")))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

/// A duration written as "7d", "12h", "90s" or "0s".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Dur(pub Duration);

impl Dur {
    pub fn parse(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.starts_with('-') {
            return Err(format!("duration `{s}` must not be negative"));
        }
        humantime::parse_duration(t)
            .map(Dur)
            .map_err(|e| format!("duration `{s}` is invalid ({e}); write e.g. `90s`, `12h` or `7d`"))
    }
    pub const fn secs(n: u64) -> Self {
        Dur(Duration::from_secs(n))
    }
}

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_zero() {
            return f.write_str("0s");
        }
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Dur::parse(&s).map_err(de::Error::custom)
    }
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(ByteSize::parse("1MiB").unwrap().0, 1 << 20);
        assert_eq!(ByteSize::parse("64 GiB").unwrap().0, 64 << 30);
        assert_eq!(ByteSize::parse("1.5KiB").unwrap().0, 1536);
        assert_eq!(ByteSize::parse("100").unwrap().0, 100);
        assert_eq!(ByteSize::parse("2GB").unwrap().0, 2_000_000_000);
        assert!(ByteSize::parse("-1GiB").unwrap_err().contains("negative"));
        assert!(ByteSize::parse("12 parsecs").unwrap_err().contains("unknown unit"));
        assert!(ByteSize::parse("lots").is_err());
    }

    #[test]
    fn sizes_display_round_trips() {
        for s in ["1MiB", "64GiB", "3KiB", "17B"] {
            assert_eq!(ByteSize::parse(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(Dur::parse("7d").unwrap().0, Duration::from_secs(7 * 86400));
        assert_eq!(Dur::parse("0s").unwrap().0, Duration::ZERO);
        assert!(Dur::parse("-3s").unwrap_err().contains("negative"));
        assert!(Dur::parse("seven days").is_err());
        assert_eq!(Dur::parse(&Dur::secs(90).to_string()).unwrap(), Dur::secs(90));
    }
}
