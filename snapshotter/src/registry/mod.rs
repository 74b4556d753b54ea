//! The OCI registry client of the snapshotter: image references, where each registry host is
//! reached (containerd's `hosts.toml`), credentials (docker `config.json` and its credential helpers, and the logins of CRI pulls), token auth, and the
//! ranged blob reads that lazy layers are made of.

pub mod auth;
pub mod client;
pub mod helper;
pub mod hosts;
pub mod keychain;
pub mod passthrough;
pub mod push;
pub mod range_stream;
pub mod reference;

pub use client::{Manifest, ManifestLayer, Registry};
pub use reference::ImageRef;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("image reference {reference:?}: {reason}")]
    Reference { reference: String, reason: String },
    #[error("{url}: {}", with_causes(.source))]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url}: the registry answered {status}{detail}")]
    Status { url: String, status: u16, detail: String },
    #[error("{url}: {reason}")]
    Blob { url: String, reason: String },
    #[error("{url}: asked for bytes {start}..{end} and got {got}")]
    Range { url: String, start: u64, end: u64, got: String },
    #[error("{url}: authentication failed: {reason}")]
    Auth { url: String, reason: String },
    #[error("{path}: {reason}")]
    Config { path: String, reason: String },
    #[error("manifest {reference}: {reason}")]
    Manifest { reference: String, reason: String },
    #[error("every host for {host} failed; the last said: {last}")]
    AllHostsFailed { host: String, last: Box<RegistryError> },
}

/// An error with its causes, which reqwest's own message ("error sending request") leaves out:
/// refused connections, TLS verdicts, bodies cut short.
pub fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}
