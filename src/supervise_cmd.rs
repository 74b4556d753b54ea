//! `strata supervise -- strata daemon ...`: the descriptor store where no systemd runs (the
//! Kubernetes DaemonSet, tests). It speaks systemd's protocol, so the daemon is the same under
//! both: the child is told `NOTIFY_SOCKET`, sends `FDSTORE=1`/`FDSTOREREMOVE=1` there, and gets
//! what is kept back as `LISTEN_FDS` when it is started again. While a FUSE descriptor is kept
//! here, the kernel keeps its mount's connection through the child's death.
//!
//! The child is started again whenever it ends, except after a clean exit (status 0: it was
//! told to stop and unmounted). SIGTERM and SIGINT are passed on and end the supervisor with
//! the child; SIGUSR2 (hand over) and SIGHUP are passed on.

use anyhow::Context;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::signal::unix::{SignalKind, signal};

/// A child that dies this soon after its start is crashing in a loop: the wait before its next
/// start doubles.
const CRASH_LOOP: Duration = Duration::from_secs(10);

/// The status a daemon exits with to be started again at once (EX_TEMPFAIL).
pub const HANDOVER_STATUS: i32 = 75;

#[derive(Debug, clap::Args)]
pub struct SuperviseArgs {
    /// Wait before starting a child that crashed again; doubles while it keeps crashing
    /// within 10 s of its start, up to 5 s.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    restart_delay: Duration,
    /// The daemon to run, and its arguments.
    #[arg(trailing_var_arg = true, required = true)]
    command: Vec<OsString>,
}

/// Kept descriptors by name, in the order they came.
type Store = Arc<Mutex<BTreeMap<String, Vec<OwnedFd>>>>;

pub async fn run(args: SuperviseArgs) -> anyhow::Result<std::process::ExitCode> {
    let name = format!("strata-supervise-{}", std::process::id());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).context("abstract socket name")?;
    let socket = UnixDatagram::bind_addr(&addr).context("cannot bind the notify socket")?;
    let store: Store = Arc::default();
    let receiving = store.clone();
    std::thread::Builder::new().name("fdstore".into()).spawn(move || receive(socket, receiving))?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut usr2 = signal(SignalKind::user_defined2())?;
    let mut hup = signal(SignalKind::hangup())?;
    let mut delay = args.restart_delay;
    loop {
        let started = Instant::now();
        let mut child = spawn(&args.command, &name, &store)?;
        let pid = nix::unistd::Pid::from_raw(child.id().context("the child has no pid")? as i32);
        let forward = |s| {
            let _ = nix::sys::signal::kill(pid, s);
        };
        let mut stopping = false;
        let status = loop {
            tokio::select! {
                status = child.wait() => break status?,
                _ = term.recv() => { stopping = true; forward(nix::sys::signal::Signal::SIGTERM) }
                _ = int.recv() => { stopping = true; forward(nix::sys::signal::Signal::SIGTERM) }
                _ = usr2.recv() => forward(nix::sys::signal::Signal::SIGUSR2),
                _ = hup.recv() => forward(nix::sys::signal::Signal::SIGHUP),
            }
        };
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), stopping) {
            (Some(code), true) => return Ok(std::process::ExitCode::from(code as u8)),
            (None, true) => return Ok(std::process::ExitCode::FAILURE),
            (Some(0), false) => {
                tracing::info!("the daemon stopped cleanly; the supervisor ends with it");
                return Ok(std::process::ExitCode::SUCCESS);
            }
            (Some(HANDOVER_STATUS), false) => {
                tracing::info!(kept = kept(&store), "the daemon handed over; starting it again");
                delay = args.restart_delay;
                continue;
            }
            (code, false) => {
                tracing::warn!(?code, signal = ?status.signal(), kept = kept(&store), ?delay, "the daemon died; starting it again");
            }
        }
        tokio::time::sleep(delay).await;
        delay =
            if started.elapsed() < CRASH_LOOP { (delay * 2).min(Duration::from_secs(5)) } else { args.restart_delay };
    }
}

fn kept(store: &Store) -> usize {
    store.lock().unwrap_or_else(|p| p.into_inner()).values().map(Vec::len).sum()
}

fn spawn(command: &[OsString], socket: &str, store: &Store) -> anyhow::Result<tokio::process::Child> {
    let (names, fds): (Vec<String>, Vec<OwnedFd>) = {
        let kept = store.lock().unwrap_or_else(|p| p.into_inner());
        let mut names = Vec::new();
        let mut fds = Vec::new();
        for (name, list) in kept.iter() {
            for fd in list {
                names.push(name.clone());
                fds.push(fd.try_clone()?);
            }
        }
        (names, fds)
    };
    let mut cmd = std::process::Command::new(&command[0]);
    cmd.args(&command[1..])
        .env("NOTIFY_SOCKET", format!("@{socket}"))
        .env("LISTEN_FDS", fds.len().to_string())
        .env("LISTEN_FDNAMES", names.join(":"))
        .env_remove("LISTEN_PID");
    let _passed = strata_cachefs::resume::fds::pass_from_three(&mut cmd, &fds)?;
    let child = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()
        .with_context(|| format!("cannot start {:?}", command[0]))?;
    Ok(child)
}

/// Takes in the child's notify messages for as long as the supervisor runs.
fn receive(socket: UnixDatagram, store: Store) {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut buf = vec![0u8; 4096];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 64]);
    loop {
        let (text, fds) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = match recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
                Ok(m) => m,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "the notify socket failed; descriptors are no longer kept");
                    return;
                }
            };
            let mut fds = Vec::new();
            if let Ok(cmsgs) = msg.cmsgs() {
                for c in cmsgs {
                    if let ControlMessageOwned::ScmRights(r) = c {
                        fds.extend(strata_cachefs::resume::fds::received(r));
                    }
                }
            }
            let n = msg.bytes;
            (String::from_utf8_lossy(&buf[..n]).into_owned(), fds)
        };
        apply(&store, &text, fds);
    }
}

/// One notify message: keep its descriptors, or drop those of its name.
fn apply(store: &Store, text: &str, fds: Vec<OwnedFd>) {
    let fields: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let name = fields.get("FDNAME").copied().unwrap_or("stored").to_owned();
    let mut kept = store.lock().unwrap_or_else(|p| p.into_inner());
    if fields.get("FDSTORE") == Some(&"1") {
        kept.entry(name).or_default().extend(fds);
    } else if fields.get("FDSTOREREMOVE") == Some(&"1") {
        kept.remove(&name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_descriptors_are_kept_by_name_and_removed_by_name() {
        let store: Store = Arc::default();
        let f = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        apply(&store, "FDSTORE=1\nFDNAME=fuse-a\n", vec![f()]);
        apply(&store, "FDSTORE=1\nFDNAME=fuse-b\n", vec![f()]);
        apply(&store, "READY=1\n", vec![]);
        assert_eq!(kept(&store), 2);
        apply(&store, "FDSTOREREMOVE=1\nFDNAME=fuse-a\n", vec![]);
        let names: Vec<String> = store.lock().unwrap().keys().cloned().collect();
        assert_eq!(names, vec!["fuse-b".to_string()]);
    }
}
