//! What a starting program reads besides its loader's files, named before it reads them. A
//! layer without a prefetch region otherwise pays a registry round trip for each such file, one
//! after another: python's start, after its libraries, opened seven (a locale, the C library's
//! charset cache, `/etc/nsswitch.conf`, four of its own modules), 0.22 s on a 20 ms link. Three
//! sources name them:
//! - the program's and its libraries' own bytes: glibc names the files it reads at start by
//!   absolute path in its read-only data (`/etc/nsswitch.conf`, the gconv cache,
//!   `/etc/localtime`); only small regular files the layers hold are taken;
//! - the C library itself, known by its name (`libc.so.6`, glibc): the three of those files that
//!   common starts read (a program that looks up a user, sets its locale or its time), asked for
//!   as soon as the library is, where its bytes name them only once it is whole; on the link
//!   above, that takes a round trip off the end of a start that reads them, and costs at most
//!   three small files fetched for nothing in one that does not;
//! - CPython's start-up, which every python container runs: the standard library modules it
//!   imports before any script, besides those frozen into the interpreter, and the UTF-8
//!   locale it switches to (PEP 538), found from where the interpreter itself lies.
//!
//! These only decide what to fetch early: a wrong guess costs the bytes of a few small files.

/// A file named in a program's bytes is fetched ahead only up to this size: the configuration
/// and cache files a C library reads at start are a few KiB, and a larger file it names (a
/// locale archive) is read in part, if at all.
pub const SMALL: u64 = 64 << 10;
/// Paths taken from one file's bytes at most: glibc names about forty, most not in an image.
const MAX_NAMED: usize = 256;
const MAX_PATH: usize = 256;
/// Library names taken from one file's first bytes at most.
const MAX_LIBRARIES: usize = 64;

/// The absolute paths that `bytes` (an ELF file's, or a script's) holds as strings of their
/// own: starting after a NUL or at the start, ending at a NUL, of path characters only, in a
/// top directory a root file system has. Each once, in the order met.
pub fn named_paths(bytes: &[u8]) -> Vec<String> {
    const TOPS: [&[u8]; 5] = [b"/etc/", b"/usr/", b"/lib/", b"/lib64/", b"/var/"];
    let mut out: Vec<String> = Vec::new();
    let mut at = 0;
    while let Some(i) = memchr(b'/', &bytes[at..]).map(|i| at + i) {
        at = i + 1;
        if i > 0 && bytes[i - 1] != 0 {
            continue;
        }
        let rest = &bytes[i..bytes.len().min(i + MAX_PATH + 1)];
        let Some(len) = memchr(0, rest) else { continue };
        let s = &rest[..len];
        let ok = TOPS.iter().any(|t| s.starts_with(t) && s.len() > t.len())
            && s.iter().all(|&c| c.is_ascii_alphanumeric() || b"/._+-@".contains(&c))
            && !s.ends_with(b"/");
        if ok {
            let path = String::from_utf8_lossy(s).into_owned();
            if !out.contains(&path) {
                out.push(path);
                if out.len() >= MAX_NAMED {
                    break;
                }
            }
        }
        at = i + len;
    }
    out
}

/// The shared-library names (`libm.so.6`) that `bytes`, the start of an ELF file, holds as
/// strings of their own: its dynamic string table's, which sits near the start, while the
/// dynamic section that says which of them are needed may lie megabytes further, in a chunk
/// still on its way. Each once, in the order met.
pub fn library_names(bytes: &[u8]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    // Whole strings only: after a NUL and before the last one.
    let terminated = &bytes[..bytes.iter().rposition(|&b| b == 0).unwrap_or(0)];
    for s in terminated.split(|&b| b == 0).skip(1) {
        let Some(rest) = s.strip_prefix(b"lib") else { continue };
        let Some(at) = rest.windows(3).position(|w| w == b".so") else { continue };
        let (stem, version) = (&rest[..at], &rest[at + 3..]);
        let ok = !stem.is_empty()
            && stem.iter().all(|&c| c.is_ascii_alphanumeric() || b"_+-.".contains(&c))
            && version.split(|&c| c == b'.').skip(1).all(|n| !n.is_empty() && n.iter().all(u8::is_ascii_digit))
            && (version.is_empty() || version.starts_with(b"."));
        if ok && s.len() <= MAX_PATH {
            let name = String::from_utf8_lossy(s).into_owned();
            if !out.contains(&name) {
                out.push(name);
                if out.len() >= MAX_LIBRARIES {
                    break;
                }
            }
        }
    }
    out
}

fn memchr(needle: u8, hay: &[u8]) -> Option<usize> {
    hay.iter().position(|&b| b == needle)
}

/// CPython's version, if `path` (a file's real path in its layer) is a CPython interpreter by
/// its name: `python3.N`, as every distribution and the official images install it.
pub fn python_version(path: &str) -> Option<(u32, u32)> {
    let name = path.rsplit('/').next()?;
    let (major, minor) = name.strip_prefix("python")?.split_once('.')?;
    let (major, minor) = (major.parse().ok()?, minor.parse().ok()?);
    (major == 3).then_some((major, minor))
}

/// What glibc, linked at `path` (its real path, `usr/lib/x86_64-linux-gnu/libc.so.6`), reads at
/// a common start, as paths from the root: `/etc/nsswitch.conf` (a user or group looked up, as
/// python's start and every shell do), `/etc/localtime` (the time zone) and the cache of its
/// character set converters, which it keeps beside itself (`gconv/`), read when a program sets a
/// UTF-8 locale. Nothing for a file of another name (musl's, say).
pub fn glibc_start(path: &str) -> Vec<String> {
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    if name != "libc.so.6" {
        return Vec::new();
    }
    let gconv = if dir.is_empty() {
        "gconv/gconv-modules.cache".to_owned()
    } else {
        format!("{dir}/gconv/gconv-modules.cache")
    };
    vec!["etc/nsswitch.conf".to_owned(), "etc/localtime".to_owned(), gconv]
}

/// The modules a CPython start imports from its standard library, as `-X importtime` shows
/// them. From 3.11 on, `site`, `os`, `codecs`, `io` and the rest of this list's older part are
/// frozen into the interpreter; the `encodings` package never is.
fn start_modules(minor: u32) -> Vec<&'static str> {
    let mut m = vec!["encodings/__init__", "encodings/aliases", "encodings/utf_8", "sitecustomize"];
    if minor < 11 {
        m.extend([
            "codecs",
            "encodings/latin_1",
            "abc",
            "io",
            "stat",
            "_collections_abc",
            "genericpath",
            "posixpath",
            "os",
            "_sitebuiltins",
            "site",
        ]);
    }
    m
}

/// What the start of the CPython interpreter at `path` (its real path, `usr/bin/python3.11`)
/// reads, as paths from the root, each with the path read in its place when the layers do not
/// hold it: for each start-up module, its compiled file under `__pycache__`, else its source;
/// then the C.UTF-8 locale's character data, which the interpreter switches to in a container
/// that sets no locale, and which the official images set.
pub fn python_start(path: &str) -> Vec<(String, Option<String>)> {
    let Some((major, minor)) = python_version(path) else { return Vec::new() };
    // The interpreter is PREFIX/bin/pythonX.Y, its library PREFIX/lib/pythonX.Y.
    let prefix = path.rsplit_once('/').map_or("", |(bin, _)| bin).rsplit_once('/').map_or("", |(p, _)| p);
    let lib = if prefix.is_empty() {
        format!("lib/python{major}.{minor}")
    } else {
        format!("{prefix}/lib/python{major}.{minor}")
    };
    let mut out = Vec::new();
    for module in start_modules(minor) {
        let (dir, name) = module.rsplit_once('/').map_or((lib.clone(), module), |(d, n)| (format!("{lib}/{d}"), n));
        out.push((format!("{dir}/__pycache__/{name}.cpython-{major}{minor}.pyc"), Some(format!("{dir}/{name}.py"))));
    }
    out.push(("usr/lib/locale/C.utf8/LC_CTYPE".to_owned(), None));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_taken_only_as_whole_strings_of_path_characters() {
        let mut b = b"\x7fELF\0\0/etc/nsswitch.conf\0/usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache\0".to_vec();
        b.extend_from_slice(
            b"x/etc/inside-another\0/etc/passwd\0/etc/passwd\0/etc/%s/fmt\0/etc/\0/tmp/x\0/proc/self\0",
        );
        b.extend_from_slice(b"/lib/x86_64-linux-gnu/\0/etc/unterminated");
        assert_eq!(
            named_paths(&b),
            ["/etc/nsswitch.conf", "/usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache", "/etc/passwd"]
        );
        let long = [b"\0/etc/".as_slice(), &[b'a'; 300], b"\0"].concat();
        assert!(named_paths(&long).is_empty(), "longer than a path a C library names");
        let many: Vec<u8> = (0..1000).flat_map(|i| format!("/etc/f{i}\0").into_bytes()).collect();
        assert_eq!(named_paths(&many).len(), MAX_NAMED);
    }

    #[test]
    fn library_names_are_whole_strings_of_a_shared_objects_form() {
        let b = b"\x7fELF\0libm.so.6\0libc.so.6\0PyList_New\0libexpat.so.1\0libz.so.1.2.13\0GLIBC_2.2.5\0libfoo.so\0xlibbar.so.1\0libbad.so.x\0libc.so.6\0lib.so.1\0libq.soup\0libend.so.2";
        assert_eq!(
            library_names(b),
            ["libm.so.6", "libc.so.6", "libexpat.so.1", "libz.so.1.2.13", "libfoo.so"],
            "not a name inside another string, a version that is not numbers, an empty stem, nor the unterminated last"
        );
    }

    #[test]
    fn glibcs_start_up_files_are_named_from_where_it_lies() {
        assert_eq!(
            glibc_start("usr/lib/x86_64-linux-gnu/libc.so.6"),
            ["etc/nsswitch.conf", "etc/localtime", "usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache"]
        );
        assert_eq!(glibc_start("usr/lib64/libc.so.6")[2], "usr/lib64/gconv/gconv-modules.cache");
        for not in
            ["lib/ld-musl-x86_64.so.1", "usr/lib/libc.so", "usr/lib/x86_64-linux-gnu/libc.so.6.bak", "libcrypt.so.1"]
        {
            assert!(glibc_start(not).is_empty(), "{not}");
        }
    }

    #[test]
    fn a_cpython_interpreter_is_known_by_its_name() {
        assert_eq!(python_version("usr/bin/python3.11"), Some((3, 11)));
        assert_eq!(python_version("opt/conda/bin/python3.10"), Some((3, 10)));
        for not in ["usr/bin/python3", "usr/bin/python2.7", "usr/bin/python3.11-config", "usr/bin/perl5.36", "python"] {
            assert_eq!(python_version(not), None, "{not}");
        }
    }

    #[test]
    fn cpython_start_up_files_are_found_from_where_the_interpreter_lies() {
        let got = python_start("usr/bin/python3.11");
        let first = |p: &str| got.iter().find(|(f, _)| f == p).map(|(_, s)| s.clone());
        assert_eq!(
            got[0],
            (
                "usr/lib/python3.11/encodings/__pycache__/__init__.cpython-311.pyc".to_owned(),
                Some("usr/lib/python3.11/encodings/__init__.py".to_owned())
            )
        );
        assert_eq!(
            first("usr/lib/python3.11/__pycache__/sitecustomize.cpython-311.pyc"),
            Some(Some("usr/lib/python3.11/sitecustomize.py".to_owned()))
        );
        assert!(!got.iter().any(|(p, _)| p.contains("/os.")), "frozen into 3.11");
        assert_eq!(got.last().unwrap(), &("usr/lib/locale/C.utf8/LC_CTYPE".to_owned(), None));
        let older: Vec<String> = python_start("usr/local/bin/python3.9").into_iter().map(|(p, _)| p).collect();
        assert!(older.contains(&"usr/local/lib/python3.9/__pycache__/os.cpython-39.pyc".to_owned()));
        assert!(older.contains(&"usr/local/lib/python3.9/encodings/__pycache__/utf_8.cpython-39.pyc".to_owned()));
        assert!(python_start("usr/bin/bash").is_empty());
    }
}
