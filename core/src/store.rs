//! The artifact store: an S3-compatible bucket (Garage locally), addressed path-style.
//!
//! Object keys are `<tenant>/<job_id>/<path>`: the tenant prefix is part of every key so that
//! store-side policies and audits can be scoped per tenant. Clients never hold the store's
//! credentials; they download through presigned GET URLs that expire with the artifact.
//! TTL is enforced by the scheduler's sweeper (`expires_at` in Postgres); the bucket lifecycle
//! rule set by [`ArtifactStore::ensure_lifecycle`] is only a backstop, since S3 lifecycle rules
//! count in whole days.

use std::time::Duration;

use anyhow::{Context, Result};
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation};
use aws_sdk_s3::presigning::PresigningConfig;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{BucketLifecycleConfiguration, ExpirationStatus, LifecycleExpiration, LifecycleRule, LifecycleRuleFilter};
use aws_sdk_s3::Client;

use crate::config::S3Settings;

/// Longest validity of a SigV4 presigned URL.
pub const MAX_PRESIGN: Duration = Duration::from_secs(7 * 24 * 3600);

/// Handle on the artifact bucket.
#[derive(Clone)]
pub struct ArtifactStore {
    client: Client,
    bucket: String,
}

/// The outcome of [`ArtifactStore::get_limited`] (the object's bytes) and
/// [`ArtifactStore::get_base64_limited`] (its base64 text).
#[derive(Debug)]
pub enum Fetched<T = Vec<u8>> {
    /// The object's content.
    Found(T),
    /// No such object.
    Missing,
    /// The object is larger than allowed (its size).
    TooLarge(u64),
}

/// The object key of an artifact.
pub fn artifact_key(tenant: &str, job_id: &str, path: &str) -> String {
    format!("{tenant}/{job_id}/{path}")
}

/// Whether an artifact at `path` of the job has a key of at most `max_key_bytes`
/// (`S3Settings::max_key_bytes`: what the store takes).
pub fn artifact_key_fits(tenant: &str, job_id: &str, path: &str, max_key_bytes: usize) -> bool {
    tenant.len() + job_id.len() + path.len() + 2 <= max_key_bytes
}

impl ArtifactStore {
    /// Build a client for the configured store. Does no I/O.
    pub fn new(s: &S3Settings) -> Self {
        let creds = Credentials::new(&s.access_key_id, &s.secret_access_key, None, None, "sandcell-env");
        let conf = aws_sdk_s3::Config::builder()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .region(Region::new(s.region.clone()))
            .endpoint_url(&s.endpoint)
            .force_path_style(true)
            .credentials_provider(creds)
            .timeout_config(TimeoutConfig::builder().operation_attempt_timeout(s.attempt_timeout).build())
            // Non-AWS stores do not all speak the newer default checksum headers.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .build();
        ArtifactStore { client: Client::from_conf(conf), bucket: s.bucket.clone() }
    }

    /// Store a large input file for `tenant` and return the `s3_key` a job names it by
    /// (`<tenant>/_uploads/<name>`). Needs the store's own credentials: for an operator's
    /// trusted backend, not for tenants.
    pub async fn upload_input(&self, tenant: &str, name: &str, bytes: Vec<u8>) -> Result<String> {
        let key = format!("{}{name}", sandcell_protocol::submission::upload_prefix(tenant));
        anyhow::ensure!(sandcell_protocol::submission::is_valid_upload_key(tenant, &key), "{name:?} is not a valid upload name");
        self.put(&key, bytes, "application/octet-stream").await?;
        Ok(key)
    }

    /// Store an object.
    pub async fn put(&self, key: &str, body: Vec<u8>, content_type: &str) -> Result<()> {
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .content_type(content_type)
            .body(ByteStream::from(body))
            .send()
            .await
            .with_context(|| format!("uploading {key}"))?;
        Ok(())
    }

    /// A presigned GET URL for `key`, valid for `ttl` (at most [`MAX_PRESIGN`]).
    pub async fn presign_get(&self, key: &str, ttl: Duration) -> Result<String> {
        let cfg = PresigningConfig::expires_in(ttl.clamp(Duration::from_secs(1), MAX_PRESIGN)).context("presign duration")?;
        let req = self.client.get_object().bucket(&self.bucket).key(key).presigned(cfg).await.with_context(|| format!("presigning {key}"))?;
        Ok(req.uri().to_string())
    }

    /// A presigned PUT URL for `key`, valid for `ttl`, for a body of `size` bytes (the length is
    /// part of what is signed, where the store checks it). The worker still refuses to fetch an
    /// input larger than its limit.
    pub async fn presign_put(&self, key: &str, ttl: Duration, size: u64) -> Result<String> {
        let cfg = PresigningConfig::expires_in(ttl.clamp(Duration::from_secs(1), MAX_PRESIGN)).context("presign duration")?;
        let len = i64::try_from(size).context("upload size")?;
        let req = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .content_length(len)
            .presigned(cfg)
            .await
            .with_context(|| format!("presigning an upload to {key}"))?;
        Ok(req.uri().to_string())
    }

    /// Open an object of at most `max_bytes`: its body, not yet read, and its size.
    async fn open_limited(&self, key: &str, max_bytes: u64) -> Result<Fetched<(ByteStream, u64)>> {
        let resp = match self.client.get_object().bucket(&self.bucket).key(key).send().await {
            Ok(r) => r,
            Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => return Ok(Fetched::Missing),
            Err(e) => return Err(e).with_context(|| format!("fetching {key}")),
        };
        let size = u64::try_from(resp.content_length().unwrap_or(0)).unwrap_or(0);
        if size > max_bytes {
            return Ok(Fetched::TooLarge(size));
        }
        Ok(Fetched::Found((resp.body, size)))
    }

    /// Read an object of at most `max_bytes` (a session's snapshot).
    pub async fn get_limited(&self, key: &str, max_bytes: u64) -> Result<Fetched> {
        let body = match self.open_limited(key, max_bytes).await? {
            Fetched::Found((body, _)) => body,
            Fetched::Missing => return Ok(Fetched::Missing),
            Fetched::TooLarge(size) => return Ok(Fetched::TooLarge(size)),
        };
        let body = body.collect().await.with_context(|| format!("reading {key}"))?.into_bytes();
        if body.len() as u64 > max_bytes {
            return Ok(Fetched::TooLarge(body.len() as u64));
        }
        // Without a copy where the body came as one chunk.
        Ok(Fetched::Found(Vec::from(body)))
    }

    /// Read an object of at most `max_bytes` as standard base64 text (input files: a sandbox
    /// gets them so), encoded as its body arrives: what is held is the text and one chunk,
    /// never the object's bytes whole beside it (a 100 MB upload took 333 MB at once when read
    /// whole, then encoded; 133 MB so).
    pub async fn get_base64_limited(&self, key: &str, max_bytes: u64) -> Result<Fetched<String>> {
        use std::io::Write as _;
        let (mut body, size) = match self.open_limited(key, max_bytes).await? {
            Fetched::Found(opened) => opened,
            Fetched::Missing => return Ok(Fetched::Missing),
            Fetched::TooLarge(size) => return Ok(Fetched::TooLarge(size)),
        };
        let capacity = usize::try_from(sandcell_protocol::submission::encoded_len(size)).unwrap_or(usize::MAX);
        let mut text = base64::write::EncoderStringWriter::from_consumer(String::with_capacity(capacity), &base64::engine::general_purpose::STANDARD);
        let mut read = 0u64;
        while let Some(chunk) = body.try_next().await.with_context(|| format!("reading {key}"))? {
            read += chunk.len() as u64;
            if read > max_bytes {
                return Ok(Fetched::TooLarge(read));
            }
            text.write_all(&chunk).with_context(|| format!("encoding {key}"))?;
        }
        Ok(Fetched::Found(text.into_inner()))
    }

    /// Delete an object (deleting a missing object is not an error in S3).
    pub async fn delete(&self, key: &str) -> Result<()> {
        self.client.delete_object().bucket(&self.bucket).key(key).send().await.with_context(|| format!("deleting {key}"))?;
        Ok(())
    }

    /// Whether an object exists.
    pub async fn exists(&self, key: &str) -> Result<bool> {
        Ok(self.size_of(key).await?.is_some())
    }

    /// An object's size, without reading it; `None` when there is no such object.
    pub async fn size_of(&self, key: &str) -> Result<Option<u64>> {
        match self.client.head_object().bucket(&self.bucket).key(key).send().await {
            Ok(head) => Ok(Some(u64::try_from(head.content_length().unwrap_or(0)).unwrap_or(0))),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_not_found()) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("checking {key}")),
        }
    }

    /// Install a lifecycle rule expiring every object after `days` (the backstop behind the sweeper).
    pub async fn ensure_lifecycle(&self, days: i32) -> Result<()> {
        let rule = LifecycleRule::builder()
            .id("sandcell-artifact-backstop")
            .status(ExpirationStatus::Enabled)
            .filter(LifecycleRuleFilter::builder().prefix("").build())
            .expiration(LifecycleExpiration::builder().days(days).build())
            .build()
            .context("building lifecycle rule")?;
        let cfg = BucketLifecycleConfiguration::builder().rules(rule).build().context("building lifecycle configuration")?;
        self.client
            .put_bucket_lifecycle_configuration()
            .bucket(&self.bucket)
            .lifecycle_configuration(cfg)
            .send()
            .await
            .context("setting the bucket lifecycle rule")?;
        Ok(())
    }
}
