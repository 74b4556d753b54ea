//! The mount table as /proc/self/mountinfo has it: read without a request to any mount.

use std::path::Path;

/// The device ("major:minor") of the topmost mount at `path`.
pub fn device_at(path: &Path) -> Option<String> {
    let abs = std::path::absolute(path).ok()?;
    let want = abs.to_str()?;
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    device_in(&table, want)
}

fn device_in(table: &str, want: &str) -> Option<String> {
    table.lines().rev().find_map(|l| {
        let mut f = l.split(' ');
        let dev = f.nth(2)?;
        let at = f.nth(1)?;
        (unescape(at) == want).then(|| dev.to_owned())
    })
}

/// Whether `path` is itself a mount point, from the kernel's table of this process's mounts.
pub fn is_mount_point(path: &Path) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    let want = path.to_string_lossy();
    let want = want.trim_end_matches('/');
    table.lines().any(|l| l.split(' ').nth(4).is_some_and(|m| unescape(m) == want))
}

/// mountinfo writes space, tab, newline and backslash in a path as octal escapes.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = u32::from(b[i + 1] - b'0') * 64 + u32::from(b[i + 2] - b'0') * 8 + u32::from(b[i + 3] - b'0');
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_topmost_mount_at_a_path_gives_the_device() {
        let t = "22 1 0:21 / /proc rw - proc proc rw\n\
                 90 30 0:52 / /mnt/data\\040set rw - fuse.strata strata:x rw\n\
                 91 90 0:53 / /mnt/data\\040set rw - fuse.strata strata:y rw\n";
        assert_eq!(super::device_in(t, "/mnt/data set").as_deref(), Some("0:53"));
        assert_eq!(super::device_in(t, "/mnt/data"), None);
    }

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(super::unescape(r"/var/lib/a\040b"), "/var/lib/a b");
        assert_eq!(super::unescape(r"/plain"), "/plain");
        assert_eq!(super::unescape(r"/tail\04"), r"/tail\04");
    }
}
