//! OCI image layout directories (`oci:DIR:TAG`), as `skopeo`, `umoci` and `ctr-remote` write
//! them: `oci-layout`, `index.json`, and content under `blobs/<alg>/<hex>`. Reading checks each
//! blob's digest. Writing puts blobs in place by rename and rewrites `index.json` last, also by
//! rename, so a conversion that stops part-way leaves the old tag as it was.

use super::ConvertError;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

#[derive(Debug, Clone)]
pub struct Layout {
    pub dir: PathBuf,
    pub tag: Option<String>,
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> ConvertError {
    move |source| ConvertError::Io { what, source }
}

impl Layout {
    /// `oci:DIR` or `oci:DIR:TAG`; `None` if `s` is not an `oci:` reference.
    pub fn parse(s: &str) -> Option<Layout> {
        let rest = s.strip_prefix("oci:")?;
        Some(match rest.rsplit_once(':') {
            Some((dir, tag)) if !tag.contains('/') && !tag.is_empty() => {
                Layout { dir: dir.into(), tag: Some(tag.to_owned()) }
            }
            _ => Layout { dir: rest.into(), tag: None },
        })
    }

    fn blob_path(&self, digest: &str) -> Result<PathBuf, ConvertError> {
        let (alg, hex) = digest
            .split_once(':')
            .filter(|(a, h)| !a.is_empty() && !h.is_empty() && h.bytes().all(|b| b.is_ascii_alphanumeric()))
            .ok_or_else(|| self.bad(format!("{digest:?} is not a digest")))?;
        Ok(self.dir.join("blobs").join(alg).join(hex))
    }

    fn bad(&self, reason: String) -> ConvertError {
        ConvertError::Image { reference: format!("oci:{}", self.dir.display()), reason }
    }

    fn index(&self) -> Result<Value, ConvertError> {
        let path = self.dir.join("index.json");
        let text = std::fs::read(&path).map_err(io_err(format!("reading {}", path.display())))?;
        serde_json::from_slice(&text).map_err(|e| self.bad(format!("index.json is not JSON: {e}")))
    }

    /// The descriptor the tag names (or the only one, without a tag).
    pub fn resolve(&self) -> Result<Value, ConvertError> {
        let index = self.index()?;
        let manifests = index["manifests"].as_array().cloned().unwrap_or_default();
        let found: Vec<&Value> = match &self.tag {
            Some(t) => manifests.iter().filter(|m| m["annotations"][REF_NAME] == t.as_str()).collect(),
            None => manifests.iter().collect(),
        };
        match (found.as_slice(), &self.tag) {
            ([one], _) => Ok((*one).clone()),
            ([], Some(t)) => Err(self.bad(format!("no image is tagged {t:?} in index.json"))),
            ([], None) => Err(self.bad("index.json lists no image".into())),
            (_, _) => Err(self.bad("index.json lists several images: name one with oci:DIR:TAG".into())),
        }
    }

    /// The bytes of blob `digest`, checked, up to `limit`.
    pub fn read_small(&self, digest: &str, limit: u64) -> Result<Vec<u8>, ConvertError> {
        let path = self.blob_path(digest)?;
        let mut bytes = Vec::new();
        std::fs::File::open(&path)
            .and_then(|f| f.take(limit + 1).read_to_end(&mut bytes))
            .map_err(io_err(format!("reading {}", path.display())))?;
        if bytes.len() as u64 > limit {
            return Err(self.bad(format!("blob {digest} is over {limit} bytes, too large for a manifest or config")));
        }
        self.check(digest, &format!("sha256:{}", hex::encode(Sha256::digest(&bytes))))?;
        Ok(bytes)
    }

    /// Copies blob `digest` to `to`, checking its digest on the way.
    pub fn copy_blob(&self, digest: &str, to: &Path) -> Result<u64, ConvertError> {
        let path = self.blob_path(digest)?;
        let mut src = std::fs::File::open(&path).map_err(io_err(format!("reading {}", path.display())))?;
        let mut dst = std::fs::File::create(to).map_err(io_err(format!("creating {}", to.display())))?;
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut len = 0u64;
        loop {
            let n = src.read(&mut buf).map_err(io_err(format!("reading {}", path.display())))?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            std::io::Write::write_all(&mut dst, &buf[..n]).map_err(io_err(format!("writing {}", to.display())))?;
            len += n as u64;
        }
        self.check(digest, &format!("sha256:{}", hex::encode(hash.finalize())))?;
        Ok(len)
    }

    fn check(&self, digest: &str, actual: &str) -> Result<(), ConvertError> {
        if digest.starts_with("sha256:") && actual != digest {
            return Err(self.bad(format!("blob {digest} is damaged: its bytes hash to {actual}")));
        }
        Ok(())
    }

    /// Puts blob `digest` in place, unless the layout has it: `fill` writes a temporary file
    /// beside it, which is then renamed, so a blob is never seen half written.
    fn put_blob(&self, digest: &str, fill: impl FnOnce(&Path) -> std::io::Result<()>) -> Result<(), ConvertError> {
        let path = self.blob_path(digest)?;
        if path.exists() {
            return Ok(());
        }
        let parent = path.parent().expect("blob paths have a parent");
        std::fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
        let tmp = parent.join(format!(".{}.partial", path.file_name().unwrap().to_string_lossy()));
        fill(&tmp).map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io_err(format!("renaming {}", tmp.display())))
    }

    /// Moves the file at `from` (whose digest is `digest`) into the layout's blobs.
    pub fn put_blob_file(&self, digest: &str, from: &Path) -> Result<(), ConvertError> {
        // A rename within the filesystem, else (across filesystems) a copy.
        self.put_blob(digest, |tmp| std::fs::rename(from, tmp).or_else(|_| std::fs::copy(from, tmp).map(|_| ())))
    }

    pub fn put_blob_bytes(&self, digest: &str, bytes: &[u8]) -> Result<(), ConvertError> {
        self.put_blob(digest, |tmp| std::fs::write(tmp, bytes))
    }

    /// Names `descriptor` with the layout's tag in `index.json`, replacing what had that tag.
    pub fn tag(&self, descriptor: Value) -> Result<(), ConvertError> {
        let mut index = if self.dir.join("index.json").exists() {
            self.index()?
        } else {
            json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []})
        };
        let mut d = descriptor;
        if let Some(t) = &self.tag {
            d["annotations"][REF_NAME] = t.clone().into();
        }
        let manifests =
            index["manifests"].as_array_mut().ok_or_else(|| self.bad("index.json has no manifests list".into()))?;
        manifests.retain(|m| match &self.tag {
            Some(t) => m["annotations"][REF_NAME] != t.as_str(),
            None => m["digest"] != d["digest"],
        });
        manifests.push(d);
        let layout_file = self.dir.join("oci-layout");
        if !layout_file.exists() {
            std::fs::write(&layout_file, br#"{"imageLayoutVersion":"1.0.0"}"#)
                .map_err(io_err(format!("writing {}", layout_file.display())))?;
        }
        let tmp = self.dir.join(".index.json.partial");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&index).expect("JSON values serialise"))
            .map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, self.dir.join("index.json")).map_err(io_err("renaming index.json".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse() {
        let l = Layout::parse("oci:/tmp/img:esgz").unwrap();
        assert_eq!((l.dir, l.tag), (PathBuf::from("/tmp/img"), Some("esgz".to_owned())));
        let l = Layout::parse("oci:relative/dir").unwrap();
        assert_eq!((l.dir, l.tag), (PathBuf::from("relative/dir"), None));
        assert!(Layout::parse("docker.io/library/busybox").is_none());
    }

    #[test]
    fn a_damaged_blob_is_named_and_a_tag_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let l = Layout { dir: dir.path().into(), tag: Some("v1".into()) };
        let digest = crate::estargz::sha256_digest(b"{}");
        l.put_blob_bytes(&digest, b"{}").unwrap();
        assert_eq!(l.read_small(&digest, 10).unwrap(), b"{}");
        l.tag(json!({"mediaType": "m", "digest": digest, "size": 2})).unwrap();
        l.tag(json!({"mediaType": "m", "digest": "sha256:00", "size": 2})).unwrap();
        assert_eq!(l.resolve().unwrap()["digest"], "sha256:00");
        std::fs::write(l.blob_path(&digest).unwrap(), b"{ }").unwrap();
        let e = l.read_small(&digest, 10).unwrap_err().to_string();
        assert!(e.contains("damaged") && e.contains(&digest), "{e}");
    }
}
