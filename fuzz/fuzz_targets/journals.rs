//! Any bytes where a mount's staging dir keeps a staged file's manifest or a directory
//! rename's journal, as a restart reads them to finish uploads and renames: a record whose
//! paths are the mount's object paths, or an error; never a panic, and never a path that would
//! have the restart write, copy or delete outside what the mount wrote.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_cachefs::core::read_journal;
use strata_cachefs::staging::{is_relative_object_path, read_manifest};

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = read_manifest(data) {
        assert!(is_relative_object_path(&m.target), "{m:?}");
    }
    if let Ok((from, to)) = read_journal(data) {
        assert!(is_relative_object_path(&from) && is_relative_object_path(&to), "{from:?} {to:?}");
        assert!(from != to && !to.starts_with(&format!("{from}/")) && !from.starts_with(&format!("{to}/")));
    }
});
