//! Upload requests: a tenant's ask for presigned PUT URLs (`docs/protocol.md` §1a). Published
//! to the intake exchange with the AMQP `type` [`UPLOAD_MESSAGE_TYPE`], judged here, answered
//! with a row in `uploads` (which notifies the tenant's channel). The tenant is the one the
//! broker vouches for, as for submissions; the keys are chosen here, under that tenant's upload
//! prefix, so a URL can write nowhere else.

use std::time::Duration;

use anyhow::Result;
use prometheus::Histogram;
use sandcell_core::store::ArtifactStore;
use sandcell_core::tenants::Quotas;
use sandcell_core::uploads::{GrantAsk, Granted};
use sandcell_protocol::upload::{upload_key, UploadGrant, UploadRequest, UploadTarget, UPLOAD_MESSAGE_TYPE};
use sandcell_protocol::{ErrorCode, Reason};
use sqlx::PgPool;

use crate::batches::Batcher;

/// Whether a delivery's AMQP `type` marks it an upload request.
pub fn is_upload_request(kind: Option<&str>) -> bool {
    kind == Some(UPLOAD_MESSAGE_TYPE)
}

/// Whom an upload request is for, by the intake's identity rules, with the request as parsed.
pub(crate) struct Attributed {
    /// The publisher, unless it is trusted: then the tenant the body names.
    pub tenant: String,
    /// The request's id.
    pub upload_id: String,
    /// The body, parsed (a tenant's broken request is still attributed: it gets a refusal).
    pub request: Result<UploadRequest, serde_json::Error>,
}

/// Attribute an upload request from `publisher` (`trusted`: it may name any tenant): the one
/// place an upload request's identity is read, for its answer and for its dead letter. `None`
/// for a message that names no valid `(tenant, upload_id)`: a trusted publisher's unparsable
/// body names nobody.
pub(crate) fn attribute(body: &[u8], publisher: &str, trusted: bool) -> Option<Attributed> {
    let request = serde_json::from_slice::<UploadRequest>(body);
    let (tenant, upload_id) = match &request {
        Ok(r) => (if trusted { r.tenant.clone() } else { publisher.to_string() }, r.upload_id.clone()),
        // Under the publisher's own name when it is a tenant; a trusted publisher's broken
        // message names nobody.
        Err(_) if trusted => return None,
        Err(_) => (publisher.to_string(), serde_json::from_slice::<serde_json::Value>(body).ok()?["upload_id"].as_str()?.to_string()),
    };
    let valid = sandcell_protocol::submission::is_valid_job_id(&upload_id) && sandcell_protocol::submission::is_valid_tenant(&tenant);
    valid.then_some(Attributed { tenant, upload_id, request })
}

/// The request of an attributed upload request, or why the intake refuses it: not an upload
/// request, naming a tenant its publisher may not, or failing its checks (files, paths, sizes
/// up to `max_bytes`). The one judgement of an upload request, for its answer and its dead
/// letter.
pub(crate) fn judge(attributed: &Attributed, trusted: bool, max_bytes: u64) -> Result<&UploadRequest, Reason> {
    let request = attributed.request.as_ref().map_err(|e| Reason::new(ErrorCode::MalformedJson, format!("not an upload request: {e}")))?;
    if !trusted && request.tenant != attributed.tenant {
        let reason = format!("published by tenant {}, the request names {:?}", attributed.tenant, request.tenant);
        return Err(Reason::new(ErrorCode::TenantMismatch, reason));
    }
    request.check(max_bytes)?;
    Ok(request)
}

/// What an upload grant allows, and for how long (the scheduler's `SANDCELL_MAX_UPLOAD_FILE_BYTES`,
/// `SANDCELL_UPLOAD_URL_TTL_S`, `SANDCELL_UPLOAD_TTL_S`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Terms {
    /// The largest file a grant may be for.
    pub max_file_bytes: u64,
    /// How long its PUT URLs work.
    pub url_ttl: Duration,
    /// How long what was put through it is kept (the configuration keeps it an hour past
    /// `url_ttl`: nothing may still be being put when its objects are removed).
    pub objects_ttl: Duration,
}

/// What an upload request comes to before anything is written.
pub(crate) enum Prepared {
    /// It names no recoverable `(tenant, upload_id)`: only counted and logged.
    Unattributable,
    /// Refused by its checks: the answer to record.
    Refused(UploadGrant),
    /// The grant to record if the tenant's quotas have room ([`Grants`]).
    Grant(GrantAsk),
}

/// Judge one upload request from `publisher` (`trusted`: it may name any tenant) and, when it
/// passes, presign its URLs: nothing is written yet.
pub(crate) async fn prepare(store: &ArtifactStore, body: &[u8], publisher: Option<&str>, trusted: bool, terms: Terms) -> Result<Prepared> {
    let Some(attributed) = publisher.and_then(|p| attribute(body, p, trusted)) else { return Ok(Prepared::Unattributable) };
    let request = match judge(&attributed, trusted, terms.max_file_bytes) {
        Ok(r) => r,
        Err(reason) => return Ok(Prepared::Refused(UploadGrant::rejected(&attributed.tenant, &attributed.upload_id, reason))),
    };
    let Attributed { tenant, upload_id, .. } = &attributed;
    let mut files = Vec::with_capacity(request.files.len());
    for f in &request.files {
        let s3_key = upload_key(tenant, upload_id, &f.path);
        let put_url = store.presign_put(&s3_key, terms.url_ttl, f.size_bytes).await?;
        files.push(UploadTarget { path: f.path.clone(), s3_key, put_url, size_bytes: f.size_bytes });
    }
    let now = chrono::Utc::now();
    let expires_at = now + chrono::Duration::from_std(terms.url_ttl).unwrap_or_default();
    let objects_expire_at = now + chrono::Duration::from_std(terms.objects_ttl).unwrap_or_default();
    let bytes = request.files.iter().map(|f| f.size_bytes).fold(0u64, u64::saturating_add);
    let grant = UploadGrant { tenant: tenant.clone(), upload_id: upload_id.clone(), status: "ready".into(), reason: None, files, expires_at: Some(expires_at) };
    Ok(Prepared::Grant(GrantAsk { grant, bytes, objects_expire_at }))
}

/// The most grants one transaction records.
pub const MAX_GRANT_BATCH: usize = 256;

/// The intake's upload grant writer: the grants waiting when it is free, up to
/// [`MAX_GRANT_BATCH`], recorded in one statement and one commit
/// ([`sandcell_core::uploads::grant_many`]), each within its tenant's quotas or refused.
///
/// Why: a grant is judged under its tenant's row lock, so a tenant's grants were recorded one
/// after another, each a transaction, a commit and a notification: a flood of 3,000 granted
/// requests (spread over the 8 partitions by upload id) left the partitions at ~600 a second,
/// and another tenant's job published behind it was recorded 4.0-6.5 s later. The writer holds
/// one database connection whatever the flood, so a grant takes no place at its tenant's gate.
/// Its handler takes one to write on its own what the writer, serving every tenant, does not: a
/// refusal, a grant whose tenant's row was held (the writer does not wait for it), and a grant
/// whose batch failed.
#[derive(Clone)]
pub struct Grants {
    writer: Batcher<GrantAsk, Granted>,
}

impl Grants {
    /// Start the writer on `pool`, registering unknown tenants with `defaults`.
    pub fn start(pool: PgPool, defaults: Quotas, batch_size: Histogram) -> Grants {
        let writer = Batcher::start("upload grants", MAX_GRANT_BATCH, batch_size, move |asks: Vec<GrantAsk>| {
            let pool = pool.clone();
            async move { crate::batches::once_more_if_deadlocked(|| sandcell_core::uploads::grant_many(&pool, &asks, &defaults, false)).await }
        });
        Grants { writer }
    }

    /// Judge `ask` with the batch it lands in: the answer that stands for its upload id, the
    /// refusal for the caller to record, [`Granted::Busy`] when its tenant's row was held by
    /// another transaction (nothing written: the batch does not wait behind one tenant), or why
    /// the batch failed.
    pub async fn grant(&self, ask: GrantAsk) -> Result<Granted> {
        self.writer.write(ask).await
    }
}

/// The intake's writer of upload refusals (a request over its tenant's quota, or invalid: a
/// bad path, another tenant's name): those waiting when it is free, up to [`MAX_GRANT_BATCH`],
/// recorded in one transaction ([`sandcell_core::uploads::record_many`]).
///
/// Why: recorded one transaction each under the tenant's gate, a tenant's flood of 3,000
/// requests past its stored-bytes quota held another tenant's job published behind it 2.1 s,
/// against 0.3 s behind 3,000 granted ones. Apart from the grant writer, so that one tenant's
/// refusals, which the grant writer hands back, never fill the batches every tenant's grants
/// wait for. A refusal takes no tenant's row lock; its batch waits at most
/// [`sandcell_core::uploads::BATCH_LOCK_TIMEOUT_MS`] for any other (a shard of a tenant's kept
/// bytes another transaction holds), and past it fails, for each to be recorded on its own.
#[derive(Clone)]
pub struct UploadRefusals {
    writer: Batcher<UploadGrant, sandcell_core::uploads::Recorded>,
}

impl UploadRefusals {
    /// Start the writer on `pool`.
    pub fn start(pool: PgPool, batch_size: Histogram) -> UploadRefusals {
        let writer = Batcher::start("upload refusals", MAX_GRANT_BATCH, batch_size, move |refusals: Vec<UploadGrant>| {
            let pool = pool.clone();
            async move { crate::batches::once_more_if_deadlocked(|| sandcell_core::uploads::record_many(&pool, &refusals, false)).await }
        });
        UploadRefusals { writer }
    }

    /// Record `refused` with the batch it lands in: the answer that stands for its upload id, or
    /// why the batch failed.
    pub async fn record(&self, refused: UploadGrant) -> Result<sandcell_core::uploads::Recorded> {
        self.writer.write(refused).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(tenant: &str, upload_id: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"tenant": tenant, "upload_id": upload_id, "files": [{"path": "a.csv", "size_bytes": 1}]})).unwrap()
    }

    #[test]
    fn a_tenants_request_is_its_own_whatever_tenant_it_names() {
        let a = attribute(&body("acme", "up-1"), "acme", false).unwrap();
        assert_eq!((a.tenant.as_str(), a.upload_id.as_str()), ("acme", "up-1"));
        assert!(a.request.is_ok());
        // Naming another tenant is judged by the answer (tenant_mismatch), under the publisher.
        let a = attribute(&body("globex", "up-1"), "acme", false).unwrap();
        assert_eq!((a.tenant.as_str(), a.request.unwrap().tenant.as_str()), ("acme", "globex"));
    }

    #[test]
    fn a_trusted_publisher_names_the_tenant_in_the_body() {
        let a = attribute(&body("acme", "up-1"), "backend", true).unwrap();
        assert_eq!((a.tenant.as_str(), a.upload_id.as_str()), ("acme", "up-1"));
    }

    #[test]
    fn a_broken_request_is_attributed_to_its_tenant_publisher_and_to_no_one_from_a_trusted_one() {
        let broken = br#"{"upload_id": "up-1", "files": "many"}"#;
        let a = attribute(broken, "acme", false).unwrap();
        assert_eq!((a.tenant.as_str(), a.upload_id.as_str()), ("acme", "up-1"));
        assert!(a.request.is_err());
        assert!(attribute(broken, "backend", true).is_none());
        assert!(attribute(b"not json", "acme", false).is_none());
    }

    #[test]
    fn the_judgement_refuses_a_broken_request_another_tenants_name_and_a_failed_check() {
        let code = |body: &[u8], trusted| {
            let attributed = attribute(body, if trusted { "backend" } else { "acme" }, trusted).unwrap();
            judge(&attributed, trusted, 1 << 20).map(|_| ()).map_err(|r| r.code)
        };
        assert!(code(&body("acme", "up-1"), false).is_ok());
        assert!(code(&body("globex", "up-1"), true).is_ok(), "a trusted publisher may name any tenant");
        assert_eq!(code(br#"{"upload_id": "up-1"}"#, false).err(), Some(ErrorCode::MalformedJson));
        assert_eq!(code(&body("globex", "up-1"), false).err(), Some(ErrorCode::TenantMismatch));
        let too_big = br#"{"tenant": "acme", "upload_id": "up-1", "files": [{"path": "a.csv", "size_bytes": 2097152}]}"#;
        assert!(code(too_big, false).is_err(), "over the size bound");
    }

    #[test]
    fn an_invalid_upload_id_or_tenant_names_no_one() {
        assert!(attribute(&body("acme", "../up"), "acme", false).is_none());
        assert!(attribute(&body("bad tenant", "up-1"), "backend", true).is_none());
    }
}
