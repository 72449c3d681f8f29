//! Large uploads by a tenant: it asks the scheduler (through the intake exchange, as it submits
//! jobs) for presigned PUT URLs under its own upload prefix, PUTs its files to them, and then
//! names them by `s3_key` in a job's `files`. A tenant holds no store credentials; the URLs
//! are the only write access it gets, to exactly the keys the scheduler chose.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::paths::validate_workspace_path;
use crate::submission::{is_valid_job_id, is_valid_tenant, is_valid_upload_key, upload_prefix};
use crate::{ErrorCode, Reason};

/// The AMQP `type` property of an upload request on the intake exchange (a message without it
/// is a [`crate::Submission`]).
pub const UPLOAD_MESSAGE_TYPE: &str = "sandcell.upload";

/// Most files one upload request may name.
pub const MAX_UPLOAD_FILES: usize = 32;

/// What a client publishes to get upload URLs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadRequest {
    /// The tenant (its own broker user's name, unless the publisher is trusted).
    pub tenant: String,
    /// Client-chosen id, unique per tenant (as a job id): the grant is found by it, and asking
    /// again with the same id returns the same grant.
    pub upload_id: String,
    /// The files to upload.
    pub files: Vec<UploadFile>,
}

/// One file of an upload request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadFile {
    /// A workspace-relative path (the path rules of input files); the object's key ends with it.
    pub path: String,
    /// Its size in bytes: the presigned URL accepts exactly this many.
    pub size_bytes: u64,
}

/// The scheduler's answer, in the `uploads` view (`SELECT grant FROM uploads WHERE tenant = $1
/// AND upload_id = $2`), announced on the tenant's notification channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadGrant {
    /// The tenant.
    pub tenant: String,
    /// The request's id.
    pub upload_id: String,
    /// `ready`, or `rejected` (see `reason`).
    pub status: String,
    /// Why it was rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// Where to PUT each file, and the `s3_key` to name it by in a job.
    #[serde(default)]
    pub files: Vec<UploadTarget>,
    /// When the URLs stop working.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
}

impl UploadGrant {
    /// The answer refusing upload `upload_id` of `tenant` for `reason`: no URLs.
    pub fn rejected(tenant: &str, upload_id: &str, reason: Reason) -> UploadGrant {
        UploadGrant {
            tenant: tenant.to_string(),
            upload_id: upload_id.to_string(),
            status: "rejected".into(),
            reason: Some(reason),
            files: vec![],
            expires_at: None,
        }
    }
}

/// Where one file goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadTarget {
    /// The path from the request.
    pub path: String,
    /// The object's key: `<tenant>/_uploads/<upload_id>/<path>`.
    pub s3_key: String,
    /// A presigned PUT URL for exactly `size_bytes` bytes.
    pub put_url: String,
    /// The size the URL accepts.
    pub size_bytes: u64,
}

/// The key of one uploaded file.
pub fn upload_key(tenant: &str, upload_id: &str, path: &str) -> String {
    format!("{}{upload_id}/{path}", upload_prefix(tenant))
}

impl UploadRequest {
    /// Check the request (`max_file_bytes`: the largest input file a worker fetches).
    pub fn check(&self, max_file_bytes: u64) -> Result<(), Reason> {
        let invalid = |m: String| Err(Reason::new(ErrorCode::InvalidValue, m));
        if !is_valid_tenant(&self.tenant) {
            return invalid(format!("tenant {:?} is not a valid tenant name", self.tenant));
        }
        if !is_valid_job_id(&self.upload_id) {
            return invalid("upload_id must be 1-128 of [A-Za-z0-9._:-]".into());
        }
        if self.files.is_empty() || self.files.len() > MAX_UPLOAD_FILES {
            return Err(Reason::new(ErrorCode::TooManyFiles, format!("{} files; an upload names 1 to {MAX_UPLOAD_FILES}", self.files.len())));
        }
        let mut seen = std::collections::HashSet::new();
        for f in &self.files {
            validate_workspace_path(&f.path).map_err(|e| Reason::new(ErrorCode::InvalidFilePath, format!("upload file {:?}: {e}", f.path)))?;
            // The key a job will name it by must be one a job may name (and the store can
            // delete): an upload id of `.` or `..`, or a key over 1024 bytes, is neither.
            if !is_valid_upload_key(&self.tenant, &upload_key(&self.tenant, &self.upload_id, &f.path)) {
                return Err(Reason::new(
                    ErrorCode::InvalidFilePath,
                    format!("upload file {:?}: its key under upload {:?} is not a valid upload key", f.path, self.upload_id),
                ));
            }
            if !seen.insert(f.path.as_str()) {
                return Err(Reason::new(ErrorCode::InvalidFilePath, format!("upload file {:?} is named twice", f.path)));
            }
            if f.size_bytes == 0 || f.size_bytes > max_file_bytes {
                return Err(Reason::new(ErrorCode::OversizeFile, format!("upload file {:?}: {} bytes; 1 to {max_file_bytes} allowed", f.path, f.size_bytes)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(path: &str, size: u64) -> UploadRequest {
        UploadRequest { tenant: "acme".into(), upload_id: "u1".into(), files: vec![UploadFile { path: path.into(), size_bytes: size }] }
    }

    #[test]
    fn an_upload_lands_under_the_tenants_own_prefix_where_a_job_may_name_it() {
        let key = upload_key("acme", "u1", "data/big.csv");
        assert_eq!(key, "acme/_uploads/u1/data/big.csv");
        assert!(crate::submission::is_valid_upload_key("acme", &key));
        assert!(!crate::submission::is_valid_upload_key("other", &key));
    }

    #[test]
    fn paths_sizes_and_ids_are_checked() {
        assert!(request("data/big.csv", 50 << 20).check(100 << 20).is_ok());
        assert_eq!(request("../etc/passwd", 1).check(100).unwrap_err().code, ErrorCode::InvalidFilePath);
        assert_eq!(request("a", 101).check(100).unwrap_err().code, ErrorCode::OversizeFile);
        assert_eq!(request("a", 0).check(100).unwrap_err().code, ErrorCode::OversizeFile);
        let mut r = request("a", 1);
        r.upload_id = "no spaces".into();
        assert_eq!(r.check(100).unwrap_err().code, ErrorCode::InvalidValue);
        r = request("a", 1);
        r.files.clear();
        assert_eq!(r.check(100).unwrap_err().code, ErrorCode::TooManyFiles);
    }

    #[test]
    fn an_upload_whose_keys_a_job_could_not_name_is_refused() {
        for id in [".", ".."] {
            let mut r = request("a.csv", 1);
            r.upload_id = id.into();
            assert_eq!(r.check(100).unwrap_err().code, ErrorCode::InvalidFilePath, "upload id {id:?}");
        }
        // A valid workspace path (4 x 255 bytes) whose key is over 1024 bytes.
        let long = ["p".repeat(255), "q".repeat(255), "r".repeat(255), "s".repeat(255)].join("/");
        assert!(validate_workspace_path(&long).is_ok());
        assert_eq!(request(&long, 1).check(100).unwrap_err().code, ErrorCode::InvalidFilePath, "a key over 1024 bytes");
        let mut twice = request("a.csv", 1);
        twice.files.push(UploadFile { path: "a.csv".into(), size_bytes: 2 });
        assert_eq!(twice.check(100).unwrap_err().code, ErrorCode::InvalidFilePath, "a path named twice");
    }
}
