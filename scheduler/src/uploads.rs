//! Upload requests: a tenant's ask for presigned PUT URLs (`docs/protocol.md` §1a). Published
//! to the intake exchange with the AMQP `type` [`UPLOAD_MESSAGE_TYPE`], judged here, answered
//! with a row in `uploads` (which notifies the tenant's channel). The tenant is the one the
//! broker vouches for, as for submissions; the keys are chosen here, under that tenant's upload
//! prefix, so a URL can write nowhere else.

use std::time::Duration;

use anyhow::Result;
use sandcell_core::store::ArtifactStore;
use sandcell_protocol::upload::{upload_key, UploadGrant, UploadRequest, UploadTarget, UPLOAD_MESSAGE_TYPE};
use sandcell_protocol::{ErrorCode, Reason};
use sqlx::PgPool;

/// Whether a delivery's AMQP `type` marks it an upload request.
pub fn is_upload_request(kind: Option<&str>) -> bool {
    kind == Some(UPLOAD_MESSAGE_TYPE)
}

/// Answer one upload request from `publisher` (`trusted`: it may name any tenant). Returns what
/// was recorded, or `None` for a message that names no recoverable `(tenant, upload_id)` (then
/// it is only counted and logged).
pub async fn answer(
    pool: &PgPool,
    store: &ArtifactStore,
    body: &[u8],
    publisher: Option<&str>,
    trusted: bool,
    max_bytes: u64,
    ttl: Duration,
) -> Result<Option<UploadGrant>> {
    let Some(publisher) = publisher else { return Ok(None) };
    let request: UploadRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            // Under the publisher's own name when it is a tenant; a trusted publisher's broken
            // message names nobody.
            let ids = serde_json::from_slice::<serde_json::Value>(body).ok().and_then(|v| v["upload_id"].as_str().map(String::from));
            return match (trusted, ids) {
                (false, Some(upload_id)) if sandcell_protocol::submission::is_valid_job_id(&upload_id) => {
                    let grant = rejected(publisher, &upload_id, Reason::new(ErrorCode::MalformedJson, format!("not an upload request: {e}")));
                    record(pool, &grant).await.map(Some)
                }
                _ => Ok(None),
            };
        }
    };
    let tenant = if trusted { request.tenant.clone() } else { publisher.to_string() };
    if !sandcell_protocol::submission::is_valid_job_id(&request.upload_id) || !sandcell_protocol::submission::is_valid_tenant(&tenant) {
        return Ok(None);
    }
    if !trusted && request.tenant != tenant {
        let reason = Reason::new(ErrorCode::TenantMismatch, format!("published by tenant {tenant}, the request names {:?}", request.tenant));
        return record(pool, &rejected(&tenant, &request.upload_id, reason)).await.map(Some);
    }
    if let Err(reason) = request.check(max_bytes) {
        return record(pool, &rejected(&tenant, &request.upload_id, reason)).await.map(Some);
    }
    let mut files = Vec::with_capacity(request.files.len());
    for f in &request.files {
        let s3_key = upload_key(&tenant, &request.upload_id, &f.path);
        let put_url = store.presign_put(&s3_key, ttl, f.size_bytes).await?;
        files.push(UploadTarget { path: f.path.clone(), s3_key, put_url, size_bytes: f.size_bytes });
    }
    let expires_at = chrono::Utc::now() + chrono::Duration::from_std(ttl).unwrap_or_default();
    let grant = UploadGrant { tenant, upload_id: request.upload_id, status: "ready".into(), reason: None, files, expires_at: Some(expires_at) };
    record(pool, &grant).await.map(Some)
}

fn rejected(tenant: &str, upload_id: &str, reason: Reason) -> UploadGrant {
    UploadGrant {
        tenant: tenant.to_string(),
        upload_id: upload_id.to_string(),
        status: "rejected".into(),
        reason: Some(reason),
        files: vec![],
        expires_at: None,
    }
}

async fn record(pool: &PgPool, grant: &UploadGrant) -> Result<UploadGrant> {
    sandcell_core::uploads::record(pool, grant).await
}
