//! Workspace path rules: the one judge of whether a file name may enter or leave a sandbox.
//!
//! Input file names come from clients and output file names come from inside the sandbox;
//! both are hostile until checked. A valid path is relative, made of non-empty components,
//! with no `.`/`..` component, no NUL or control characters, no backslash, each component at
//! most 255 bytes and the whole at most [`MAX_PATH_BYTES`].

/// Longest accepted relative path, in bytes.
pub const MAX_PATH_BYTES: usize = 1024;
/// Longest accepted path component, in bytes (the usual filesystem limit).
pub const MAX_COMPONENT_BYTES: usize = 255;

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Nothing to name a file by.
    #[error("path is empty")]
    Empty,
    /// It would name a file outside the workspace.
    #[error("path is absolute")]
    Absolute,
    /// Longer than any filesystem accepts ([`MAX_PATH_BYTES`]).
    #[error("path is longer than {MAX_PATH_BYTES} bytes")]
    TooLong,
    /// One name longer than a filesystem accepts ([`MAX_COMPONENT_BYTES`]).
    #[error("a path component is longer than {MAX_COMPONENT_BYTES} bytes")]
    ComponentTooLong,
    /// `a//b`, `./a` or `../a`: ambiguous, or a way out of the workspace.
    #[error("path has an empty, '.' or '..' component")]
    BadComponent,
    /// Bytes a file name should not hold: they break listings, logs and other systems' paths.
    #[error("path contains a NUL, control character or backslash")]
    BadCharacter,
}

/// Check a workspace-relative path. Returns it unchanged when valid.
pub fn validate_workspace_path(path: &str) -> Result<&str, PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute);
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong);
    }
    if path.chars().any(|c| c.is_control() || c == '\\') {
        return Err(PathError::BadCharacter);
    }
    for component in path.split('/') {
        if component.is_empty() || component == "." || component == ".." {
            return Err(PathError::BadComponent);
        }
        if component.len() > MAX_COMPONENT_BYTES {
            return Err(PathError::ComponentTooLong);
        }
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_names_pass() {
        for p in ["data.csv", "reports/q3/summary.pdf", "ünïcode name.txt", ".hidden"] {
            assert_eq!(validate_workspace_path(p), Ok(p));
        }
    }

    #[test]
    fn hostile_names_are_refused() {
        assert_eq!(validate_workspace_path(""), Err(PathError::Empty));
        assert_eq!(validate_workspace_path("/etc/passwd"), Err(PathError::Absolute));
        assert_eq!(validate_workspace_path("../x"), Err(PathError::BadComponent));
        assert_eq!(validate_workspace_path("a/../../x"), Err(PathError::BadComponent));
        assert_eq!(validate_workspace_path("a//b"), Err(PathError::BadComponent));
        assert_eq!(validate_workspace_path("a/./b"), Err(PathError::BadComponent));
        assert_eq!(validate_workspace_path("dir/"), Err(PathError::BadComponent));
        assert_eq!(validate_workspace_path("a\0b"), Err(PathError::BadCharacter));
        assert_eq!(validate_workspace_path("a\nb"), Err(PathError::BadCharacter));
        assert_eq!(validate_workspace_path("..\\x"), Err(PathError::BadCharacter));
        assert_eq!(validate_workspace_path(&"x".repeat(256)), Err(PathError::ComponentTooLong));
        let long = vec!["y".repeat(200); 6].join("/");
        assert_eq!(validate_workspace_path(&long), Err(PathError::TooLong));
    }
}
