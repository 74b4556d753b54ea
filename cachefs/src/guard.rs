//! The mount guard: a small process of our own that detaches this process's FUSE mounts if it
//! dies without unmounting them (SIGKILL, OOM kill, abort).
//!
//! fusermount3's auto-unmount helper does this too, but it looks once: it wakes when our control
//! socket closes and unmounts only if opening the mount then fails with ENOTCONN. The kernel
//! releases a dead process's files one by one, so on a busy node the helper can open the mount
//! while our /dev/fuse descriptors are still being released. The open then waits and fails with
//! ECONNABORTED when the connection is torn down, and the helper leaves the dead mount behind.
//! The guard keeps asking until the answer is final, so no dead mount stays.

use crate::mount::Probe;
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::io::{BufRead, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The hidden subcommand of the `strata` binary that runs [`run`].
pub const SUBCOMMAND: &str = "__mount-guard";

/// How long the guard keeps trying after its parent died.
const PATIENCE: Duration = Duration::from_secs(30);

static GUARD: OnceLock<Option<Mutex<ChildStdin>>> = OnceLock::new();

/// Starts the guard for this process. Call it before the first mount: a process spawned while
/// a mount is being set up could inherit that mount's /dev/fuse descriptor and keep a dead
/// mount's connection open. Without a guard (it failed to start, or this was never called),
/// mounts rely on fusermount3's helper alone.
pub fn start() {
    GUARD.get_or_init(|| {
        let exe = std::env::current_exe().ok()?;
        let spawned = Command::new(exe)
            .arg(SUBCOMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn();
        match spawned {
            Ok(mut child) => child.stdin.take().map(Mutex::new),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the mount guard; a crash may leave dead mounts behind");
                None
            }
        }
    });
}

fn tell(op: char, path: &Path) {
    let Some(Some(stdin)) = GUARD.get() else { return };
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let line = format!("{op}{}\n", hex::encode(path.as_os_str().as_bytes()));
    let mut stdin = stdin.lock().unwrap_or_else(|p| p.into_inner());
    if let Err(e) = stdin.write_all(line.as_bytes()) {
        tracing::warn!(path = %path.display(), error = %e, "the mount guard is gone");
    }
}

/// The guard detaches `path` if this process dies while it is mounted.
pub fn watch(path: &Path) {
    tell('+', path);
}

/// `path` was unmounted: nothing for the guard to do there any more.
pub fn forget(path: &Path) {
    tell('-', path);
}

/// The guard process: reads the mounts to watch from stdin until its parent closes it (by
/// exiting or dying), then detaches each one still mounted with a dead connection.
pub fn run() -> std::process::ExitCode {
    // The signals that end a service's processes must not end the guard before its work; it
    // exits by itself within seconds. (SIGKILL cannot be blocked, and needs no answer.)
    let _ = nix::sys::signal::SigSet::all().thread_block();
    let mut watched = BTreeSet::new();
    for line in std::io::stdin().lock().split(b'\n') {
        let Ok(line) = line else { break };
        let (op, rest) = match line.split_first() {
            Some((op, rest)) => (*op, rest),
            None => continue,
        };
        let Ok(bytes) = hex::decode(rest) else { continue };
        let path = PathBuf::from(OsString::from_vec(bytes));
        match op {
            b'+' => watched.insert(path),
            b'-' => watched.remove(&path),
            _ => continue,
        };
    }
    let deadline = Instant::now() + PATIENCE;
    let (tx, rx) = std::sync::mpsc::channel();
    let count = watched.len();
    for path in watched {
        let tx = tx.clone();
        // A thread each: an open of a mount whose connection somebody else keeps alive would
        // wait for ever, and must not hold up the others.
        std::thread::spawn(move || {
            detach_when_dead(&path, deadline);
            let _ = tx.send(());
        });
    }
    for _ in 0..count {
        if rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err() {
            break;
        }
    }
    std::process::ExitCode::SUCCESS
}

/// Detaches `path` once opening it says its FUSE connection is gone, asking again while the
/// connection is being torn down. A live mount, or a directory already unmounted, is left alone.
fn detach_when_dead(path: &Path, deadline: Instant) {
    while Instant::now() < deadline {
        match crate::mount::detach_if_dead(path) {
            Probe::TearingDown => std::thread::sleep(Duration::from_millis(50)),
            Probe::Detached => {
                eprintln!("strata mount guard: detached {}, left mounted by a process that died", path.display());
                return;
            }
            Probe::LeftAlone => return,
        }
    }
}
