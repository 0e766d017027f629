//! Files that hold secrets.

/// Warns when the secret file at `path` may be read by its group or by others: whoever
/// reads it holds the secret. One shape only is let pass: Kubernetes mounts a secret
/// `root:<fsGroup>` readable by that group alone, and the pod runs with that group as its own
/// (a group other than root's, read and nothing more).
pub fn warn_if_exposed(what: &str, path: &std::path::Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if let Ok(metadata) = std::fs::metadata(path) {
            let mode = metadata.permissions().mode() & 0o777;
            // `/proc/self` belongs to the process's effective user and group (Linux).
            let mounted_for_our_group = mode & 0o077 == 0o040
                && metadata.uid() == 0
                && metadata.gid() != 0
                && std::fs::metadata("/proc/self").is_ok_and(|own| own.gid() == metadata.gid());
            if mode & 0o077 != 0 && !mounted_for_our_group {
                tracing::warn!(file = %path.display(), mode = format!("{mode:04o}"),
                    "the {what} file may be read by its group or others: `chmod 600` it");
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (what, path);
}
