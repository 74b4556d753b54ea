//! Binding a unix socket that only root may use, as the daemon's admin, snapshotter and CSI
//! sockets are: whoever can call them can read any data and mount anything. A socket file left
//! by a dead process is replaced; one that still answers is never taken over.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use tokio::net::{UnixListener, UnixStream};

#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("another process is already listening on {0}")]
    InUse(PathBuf),
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Binds `path` with mode 0600, making its directory if missing.
pub async fn bind_private(path: &Path) -> Result<UnixListener, BindError> {
    let err = |what| move |source| BindError::Io { path: path.to_owned(), what, source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err("cannot create its directory"))?;
    }
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            return Err(BindError::InUse(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(err("cannot remove the stale socket"))?;
    }
    let listener = UnixListener::bind(path).map_err(err("cannot bind"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err("cannot set mode 0600"))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/s.sock");
        let live = bind_private(&path).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(bind_private(&path).await, Err(BindError::InUse(_))));
        drop(live);
        bind_private(&path).await.expect("the socket of a closed listener is replaced");
    }
}
