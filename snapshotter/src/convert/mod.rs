//! `strata convert`: images into eStargz that both Strata and stargz-snapshotter read lazily.
//! Layers are rewritten from their tar by `strata_format::write`, and fed from local files by
//! `layer`; images are converted from their manifests (`image`), between registries and OCI
//! layout directories (`layout`).

pub mod image;
pub mod layer;
pub mod layout;
pub use strata_format::write::{estargz_out, plan, tar_index};

pub use estargz_out::{DEFAULT_CHUNK_SIZE, Format, Options};
pub use image::{IfConverted, Job, Place, Progress, Report};
pub use plan::Pattern;

use crate::registry::RegistryError;

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("layer {layer}: {reason}")]
    Layer { layer: String, reason: String },
    #[error("{reference}: {reason}")]
    Image { reference: String, reason: String },
    #[error(
        "{reference} is already {format} (every layer has a TOC digest); --if-converted reconvert converts it again, skip copies it as it is"
    )]
    AlreadyConverted { reference: String, format: &'static str },
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("{0}")]
    Usage(String),
}
