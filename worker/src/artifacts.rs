//! Storing what a job produced: output files and binary rich outputs go to the object store
//! under `<tenant>/<job_id>/`, each with a presigned URL and an expiry from the job's TTL.
//!
//! Paths come from inside the sandbox and are checked again here with the same rule that
//! guards input files ([`sandcell_protocol::paths`]); a path that fails it is never stored.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Result;
use chrono::Utc;
use sandcell_core::jobs::NewArtifact;
use sandcell_core::store::{artifact_key, ArtifactStore};
use sandcell_protocol::paths::validate_workspace_path;
use sandcell_protocol::{ArtifactKind, ExecutionLimits, Output};
use sha2::{Digest, Sha256};

use crate::outcome::{DisplayPart, OutputFile, OutputKind, RawOutput};

/// Stored outputs: the rich outputs with artifact references, and the artifact rows.
pub struct Stored {
    /// Rich outputs for the result.
    pub outputs: Vec<Output>,
    /// Artifacts to record.
    pub artifacts: Vec<NewArtifact>,
}

/// Upload files and binary outputs. Fails on the first store error (the caller reports
/// `storage_failed`); nothing is recorded for a job whose uploads failed, so what was uploaded
/// before the failure is deleted again (tried once: the bucket's lifecycle rule is the
/// backstop for a store that fails the deletes too).
pub async fn store_all(
    store: &ArtifactStore,
    tenant: &str,
    job_id: &str,
    limits: &ExecutionLimits,
    files: Vec<OutputFile>,
    raw_outputs: Vec<RawOutput>,
) -> Result<Stored> {
    let mut uploaded = Vec::new();
    let stored = store_each(store, tenant, job_id, limits, files, raw_outputs, &mut uploaded).await;
    if stored.is_err() {
        for key in &uploaded {
            if let Err(e) = store.delete(key).await {
                tracing::warn!(key = %key, error = format!("{e:#}"), "could not delete an artifact of a job whose storing failed");
            }
        }
    }
    stored
}

/// [`store_all`]'s uploads, noting each key uploaded in `uploaded`.
async fn store_each(
    store: &ArtifactStore,
    tenant: &str,
    job_id: &str,
    limits: &ExecutionLimits,
    files: Vec<OutputFile>,
    raw_outputs: Vec<RawOutput>,
    uploaded: &mut Vec<String>,
) -> Result<Stored> {
    let ttl = Duration::from_secs(limits.artifact_ttl_s);
    let mut artifacts = Vec::new();
    for OutputFile { path, bytes, requested } in files {
        // Checked when the file arrived (`Outcome::admit_file`); a second look costs nothing.
        if let Err(e) = validate_workspace_path(&path) {
            anyhow::bail!("an output path that fails the path rules reached storage: {path:?}: {e}");
        }
        let content_type = mime_guess::from_path(&path).first_or_octet_stream().essence_str().to_string();
        // A file the job asked for that it also changed is reported as written (`file`).
        let kind = if requested { ArtifactKind::Fetched } else { ArtifactKind::File };
        artifacts.push(upload(store, (tenant, job_id), &path, kind, &content_type, bytes, ttl, uploaded).await?);
    }
    let mut outputs = Vec::with_capacity(raw_outputs.len());
    for raw in raw_outputs {
        let mut refs = BTreeMap::new();
        for DisplayPart { mime, path, bytes } in raw.binary {
            let a = upload(store, (tenant, job_id), &path, ArtifactKind::Display, &mime, bytes, ttl, uploaded).await?;
            refs.insert(mime, a.path.clone());
            artifacts.push(a);
        }
        outputs.push(match raw.kind {
            OutputKind::ExecuteResult => Output::ExecuteResult { data: raw.text, artifacts: refs },
            OutputKind::DisplayData => Output::DisplayData { data: raw.text, artifacts: refs },
        });
    }
    Ok(Stored { outputs, artifacts })
}

#[allow(clippy::too_many_arguments)]
/// Upload one artifact of the job `(tenant, job_id)`, its key noted in `uploaded` first (a put
/// that failed may have stored it all the same).
async fn upload(
    store: &ArtifactStore,
    (tenant, job_id): (&str, &str),
    path: &str,
    kind: ArtifactKind,
    content_type: &str,
    bytes: Vec<u8>,
    ttl: Duration,
    uploaded: &mut Vec<String>,
) -> Result<NewArtifact> {
    let key = artifact_key(tenant, job_id, path);
    let sha256 = hex::encode(Sha256::digest(&bytes));
    let size_bytes = bytes.len() as i64;
    uploaded.push(key.clone());
    store.put(&key, bytes, content_type).await?;
    let expires_at = Utc::now() + chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::days(7));
    let download_url = store.presign_get(&key, ttl).await?;
    Ok(NewArtifact { path: path.to_string(), kind, size_bytes, content_type: content_type.to_string(), sha256, s3_key: key, expires_at, download_url })
}
