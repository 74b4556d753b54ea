//! RFC 3339 times as TOCs carry them (`2006-01-02T15:04:05Z`, maybe with a fraction or an
//! offset), to seconds since the Unix epoch, and back. Small enough not to need a date crate.

/// Seconds and nanoseconds since the epoch, or `None` if `s` is not RFC 3339.
pub fn parse_rfc3339(s: &str) -> Option<(i64, u32)> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = b.get(r)?;
        part.iter().all(u8::is_ascii_digit).then(|| std::str::from_utf8(part).ok()?.parse().ok())?
    };
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, min, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || min > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut nanos = 0u32;
    if b[i] == b'.' {
        let start = i + 1;
        i = start;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let digits = &s[start..i];
        if digits.is_empty() {
            return None;
        }
        let padded: String = digits.chars().chain(std::iter::repeat('0')).take(9).collect();
        nanos = padded.parse().ok()?;
    }
    let offset = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let m = num(i + 1..i + 3)? * 3600 + num(i + 4..i + 6)? * 60;
            if *sign == b'+' { m } else { -m }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    Some((days * 86400 + hour * 3600 + min * 60 + sec - offset, nanos))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

/// `secs` since the epoch as the TOC writes it: `2006-01-02T15:04:05Z`, UTC, whole seconds.
pub fn format_rfc3339(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// The date of a day count since 1970-01-01 (the inverse of `days_from_civil`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatted_times_parse_back() {
        for secs in [0, 1, 951782400, 1700000000, 4102444799, -86401] {
            let text = format_rfc3339(secs);
            assert_eq!(parse_rfc3339(&text), Some((secs, 0)), "{text}");
        }
        assert_eq!(format_rfc3339(1700000000), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn toc_times_parse_to_epoch_seconds() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some((0, 0)));
        assert_eq!(parse_rfc3339("2006-01-02T15:04:05Z"), Some((1136214245, 0)));
        assert_eq!(parse_rfc3339("2024-02-29T12:00:00.5Z"), Some((1709208000, 500_000_000)));
        assert_eq!(parse_rfc3339("2006-01-02T17:04:05+02:00"), Some((1136214245, 0)));
        assert_eq!(parse_rfc3339("1969-12-31T23:59:59Z"), Some((-1, 0)));
        for bad in ["", "2006-01-02", "2006-13-02T15:04:05Z", "2006-01-02T15:04:05", "2006-01-02T15:04:05Zx"] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }
}
