//! Which process opened each file handle that writes. A close is a flush, and so is every
//! close of a copy of the descriptor: a child forked while a checkpoint is being written
//! closes its copy at its exec or exit, and publishing then would put a partial checkpoint in
//! the store. So only the opening process's flushes publish; the others are answered at once,
//! and the last close (release) still publishes whatever no flush did. fsync always publishes:
//! it is asked for.

use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Openers(Mutex<HashMap<u64, u32>>);

impl Openers {
    /// Handle `fh` was opened for writing by the thread `pid`.
    pub fn opened(&self, fh: u64, pid: u32) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(fh, process_of(pid));
    }

    pub fn released(&self, fh: u64) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&fh);
    }

    /// Whether a flush of `fh` by the thread `pid` comes from the process that opened it (or
    /// the handle does not write).
    pub fn is_opener(&self, fh: u64, pid: u32) -> bool {
        let opener = self.0.lock().unwrap_or_else(|p| p.into_inner()).get(&fh).copied();
        opener.is_none_or(|o| o == process_of(pid))
    }
}

/// The process (thread group) of thread `pid`: the kernel names the calling thread in a FUSE
/// request, and a writer may open on one thread and close on another. A thread gone from
/// /proc is taken as its own process.
fn process_of(pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_of_the_opener_is_the_opener_and_a_child_is_not() {
        let o = Openers::default();
        let me = std::process::id();
        o.opened(7, me);
        // This thread's id, from /proc/thread-self (`PID/task/TID`).
        let tid = || {
            let link = std::fs::read_link("/proc/thread-self").unwrap();
            link.file_name().unwrap().to_str().unwrap().parse::<u32>().unwrap()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(tid()).unwrap();
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert_ne!(tid, me);
        assert!(o.is_opener(7, tid), "another thread of the opening process");
        done_tx.send(()).unwrap();
        t.join().unwrap();
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        assert!(!o.is_opener(7, child.id()), "a child process");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(o.is_opener(8, child.id()), "a handle that does not write");
        o.released(7);
        assert!(o.is_opener(7, 1), "a released handle");
    }
}
