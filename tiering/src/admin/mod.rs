//! The admin API of the node agent: JSON over HTTP on a unix socket (mode 0600), spoken by the
//! `strata tier` CLI.

pub mod api;
pub mod client;
pub mod server;
