//! A standalone `strata mount` process under test, and its mount point.

use super::BIN;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Killed and unmounted on drop, so a failing test leaves no mount behind.
pub struct Mount {
    pub child: Option<Child>,
    pub mnt: PathBuf,
    pub log: PathBuf,
    pub _dir: tempfile::TempDir,
}

pub fn mounted(mnt: &Path) -> bool {
    let m = std::fs::read_to_string("/proc/mounts").unwrap();
    let needle = format!(" {} fuse.strata ", mnt.display());
    m.contains(&needle)
}

impl Mount {
    pub fn start(source: &str, extra: &[&str]) -> Mount {
        Self::start_in(tempfile::tempdir().unwrap(), source, extra)
    }

    pub fn start_in(dir: tempfile::TempDir, source: &str, extra: &[&str]) -> Mount {
        let mnt = dir.path().join("mnt");
        let _ = std::fs::create_dir(&mnt);
        let log = dir.path().join("mount.log");
        let child = Command::new(BIN)
            .arg("mount")
            .arg(source)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(extra)
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap())
            .spawn()
            .unwrap();
        let mut m = Mount { child: Some(child), mnt, log, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !mounted(&m.mnt) {
            if let Some(s) = m.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("strata mount exited with {s}:\n{}", m.log());
            }
            assert!(Instant::now() < deadline, "not mounted after 30s:\n{}", m.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        m
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// SIGTERM, then the process must exit and take its mount with it.
    pub fn stop(&mut self) {
        let mut c = self.child.take().unwrap();
        Command::new("kill").arg("-TERM").arg(c.id().to_string()).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while c.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "strata mount ignored SIGTERM:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!mounted(&self.mnt), "the mount outlived its process");
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("fusermount3").args(["-u", "-z"]).arg(&self.mnt).stderr(Stdio::null()).status();
    }
}
