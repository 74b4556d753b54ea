//! What N nodes starting or pulling one image asked of the registry, from its own log: tag
//! resolutions, manifest GETs per manifest, and GETs of the layers per 1 MiB segment of them
//! (a TOC read by each node on its own would add one per node and layer). Goals: one tag
//! resolution and one GET per manifest for the cluster, and at most one GET per segment.

use super::origin_log::Mark;
use std::collections::HashSet;
use strata_snapshotter::peer_blobs::SEGMENT;

pub struct Counts {
    pub workload: &'static str,
    pub n: usize,
    pub tag_asks: usize,
    pub manifest_gets: usize,
    pub manifests: usize,
    pub access_heads: usize,
    pub layer_gets: usize,
    pub segments: u64,
}

/// The counts since `mark` for repository `repo`, whose layers are `layers` (digest, size).
pub fn count(workload: &'static str, n: usize, mark: &Mark, repo: &str, layers: &[(String, u64)]) -> Counts {
    let requests = mark.requests();
    let manifests_at = format!("/v2/{repo}/manifests/");
    let mut c = Counts {
        workload,
        n,
        tag_asks: 0,
        manifest_gets: 0,
        manifests: 0,
        access_heads: 0,
        layer_gets: 0,
        segments: layers.iter().map(|(_, size)| size.div_ceil(SEGMENT)).sum(),
    };
    let mut manifests = HashSet::new();
    for r in &requests {
        let (method, target) = r.split_once(' ').unwrap_or((r, ""));
        let target = target.split('?').next().unwrap_or(target);
        if let Some(reference) = target.strip_prefix(&manifests_at) {
            match (method, reference.starts_with("sha256:")) {
                (_, false) => c.tag_asks += 1,
                ("GET", true) => {
                    c.manifest_gets += 1;
                    manifests.insert(reference.to_owned());
                }
                _ => c.access_heads += 1,
            }
        } else if method == "GET" && layers.iter().any(|(d, _)| target.ends_with(&format!("/blobs/{d}"))) {
            c.layer_gets += 1;
        } else if method == "HEAD" {
            c.access_heads += 1;
        }
    }
    c.manifests = manifests.len();
    c
}

pub fn render(rows: &[Counts]) -> String {
    let mut t = String::from(
        "\nRegistry requests, from its log: (c) and (m) through each node's mirror (`pull`, `resolve`).\n\n\
         | workload | N | tag resolutions | manifest GETs ÷ manifests | layer GETs ÷ 1 MiB segments | HEADs (access checks) |\n\
         |---|---|---|---|---|---|\n",
    );
    for r in rows {
        t += &format!(
            "| ({}) | {} | {} | {:.2} | {:.3} | {} |\n",
            r.workload,
            r.n,
            r.tag_asks,
            r.manifest_gets as f64 / r.manifests.max(1) as f64,
            r.layer_gets as f64 / r.segments.max(1) as f64,
            r.access_heads
        );
    }
    t
}
