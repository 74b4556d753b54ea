//! The program an image's containers run by default, fetched with its loader's files while the
//! pull finishes. A layer without a prefetch region leaves a container's start to fetch each
//! file as it reads it, a round trip each. The image's config names the program most of its
//! containers start (Kubernetes runs the image's entrypoint unless a pod says otherwise), so
//! as soon as the layer holding it is mounted, its first bytes, and through [`crate::loader`]
//! its interpreter and libraries, are asked for, while containerd finishes the pull and runc
//! sets the container up. A container that runs something else costs those bytes, no more.

use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct RunConfig {
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
}

#[derive(Deserialize)]
struct ImageConfig {
    #[serde(default)]
    config: Option<RunConfig>,
}

/// The PATH a container gets when its image sets none (runc's and containerd's default).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// PATH entries looked through at most.
const MAX_DIRS: usize = 32;

/// Where the program an image config runs may be, in the order its start would look: its
/// entrypoint's first word, else its command's, through the config's PATH if it has no slash.
/// Empty for a config that names no program or does not parse.
pub fn program_paths(config: &[u8]) -> Vec<String> {
    let Ok(ImageConfig { config: Some(run) }) = serde_json::from_slice::<ImageConfig>(config) else {
        return Vec::new();
    };
    let argv = run.entrypoint.filter(|e| !e.is_empty()).or(run.cmd).unwrap_or_default();
    let Some(program) = argv.into_iter().next().filter(|p| !p.is_empty() && !p.contains('\0')) else {
        return Vec::new();
    };
    if program.starts_with('/') {
        return vec![program];
    }
    if program.contains('/') {
        return vec![format!("{}/{program}", run.working_dir.unwrap_or_default())];
    }
    let path = run.env.iter().flatten().find_map(|e| e.strip_prefix("PATH=")).unwrap_or(DEFAULT_PATH);
    path.split(':').filter(|d| d.starts_with('/')).take(MAX_DIRS).map(|d| format!("{d}/{program}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_entrypoint_comes_first_then_the_command_through_path() {
        let both = br#"{"config":{"Entrypoint":["/docker-entrypoint.sh"],"Cmd":["nginx"],"Env":["PATH=/usr/bin"]}}"#;
        assert_eq!(program_paths(both), ["/docker-entrypoint.sh"]);
        let cmd = br#"{"config":{"Cmd":["python3","-c","1"],"Env":["LANG=C","PATH=/usr/local/bin:/usr/bin"]}}"#;
        assert_eq!(program_paths(cmd), ["/usr/local/bin/python3", "/usr/bin/python3"]);
        // An empty entrypoint leaves the command; no PATH gives the default one.
        let no_path = br#"{"config":{"Entrypoint":[],"Cmd":["sh"]}}"#;
        assert_eq!(program_paths(no_path).len(), 6);
        assert_eq!(program_paths(no_path)[5], "/bin/sh");
        // A relative program runs from the working directory.
        let relative = br#"{"config":{"Cmd":["./serve"],"WorkingDir":"/app"}}"#;
        assert_eq!(program_paths(relative), ["/app/./serve"]);
    }

    #[test]
    fn a_config_without_a_program_names_nothing() {
        for config in [
            &br#"{"config":{}}"#[..],
            br#"{"config":{"Cmd":[""]}}"#,
            br#"{"architecture":"amd64"}"#,
            br#"{"config":{"Cmd":"not a list"}}"#,
            b"not json",
        ] {
            assert_eq!(program_paths(config), Vec::<String>::new(), "{}", String::from_utf8_lossy(config));
        }
    }
}
