//! Image references as containerd and Docker write them: `[host[:port]/]repo[:tag][@digest]`,
//! with Docker Hub's defaults for a bare name.

use super::RegistryError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// `host[:port]` as written (Docker Hub is `docker.io`).
    pub host: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl ImageRef {
    pub fn parse(s: &str) -> Result<ImageRef, RegistryError> {
        let err = |reason: &str| RegistryError::Reference { reference: s.to_owned(), reason: reason.to_owned() };
        if s.is_empty() || s.contains(char::is_whitespace) {
            return Err(err("empty or contains whitespace"));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if !d.contains(':') {
                    return Err(err("the digest after @ has no algorithm"));
                }
                (r, Some(d.to_owned()))
            }
            None => (s, None),
        };
        let (host, path) = match rest.split_once('/') {
            Some((first, path)) if first.contains(['.', ':']) || first == "localhost" => (first.to_owned(), path),
            _ => ("docker.io".to_owned(), rest),
        };
        // A tag is a ':' after the last '/', so a port in the host is not taken for one.
        let (repository, tag) = match path.rsplit_once(':') {
            Some((repo, tag)) if !tag.contains('/') => (repo.to_owned(), Some(tag.to_owned())),
            _ => (path.to_owned(), None),
        };
        let repository =
            if host == "docker.io" && !repository.contains('/') { format!("library/{repository}") } else { repository };
        if repository.is_empty()
            || !repository.split('/').all(|c| {
                !c.is_empty() && c.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
            })
        {
            return Err(err("the repository must be lowercase path components"));
        }
        Ok(ImageRef { host, repository, tag, digest })
    }

    /// What to ask the registry for: the digest if pinned, else the tag (default `latest`).
    pub fn object(&self) -> &str {
        self.digest.as_deref().or(self.tag.as_deref()).unwrap_or("latest")
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.host, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_as_containerd_reads_them() {
        let r = ImageRef::parse("127.0.0.1:5000/strata/busybox:1").unwrap();
        assert_eq!(
            (r.host.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("127.0.0.1:5000", "strata/busybox", Some("1"))
        );
        let r = ImageRef::parse("busybox").unwrap();
        assert_eq!((r.host.as_str(), r.repository.as_str(), r.object()), ("docker.io", "library/busybox", "latest"));
        let r = ImageRef::parse("ghcr.io/org/app@sha256:abc").unwrap();
        assert_eq!((r.tag.as_deref(), r.object()), (None, "sha256:abc"));
        let r = ImageRef::parse("localhost:5000/app").unwrap();
        assert_eq!((r.host.as_str(), r.object()), ("localhost:5000", "latest"));
        for bad in ["", "a b", "Registry.io/UPPER:1", "host.io//x", "x@nodigest"] {
            assert!(ImageRef::parse(bad).is_err(), "{bad}");
        }
    }
}
