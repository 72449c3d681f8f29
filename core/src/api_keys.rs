//! API keys: the credentials of clients that reach sandcell over HTTP (the E2B-compatible
//! gateway), each naming one tenant.
//!
//! A key is `sk_sandcell_` and 48 random hex digits, printed once by `sandcell-admin key
//! create`; the table keeps only its SHA-256, so reading the table does not yield a key. The one
//! place a key is turned into a tenant is [`ApiKeys::tenant_of`].

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::tenants::random_hex;

/// What every key starts with (so a leaked key is recognisable by secret scanners).
pub const KEY_PREFIX: &str = "sk_sandcell_";

/// A key just made: its id (for logs and revocation) and the secret itself (shown once).
#[derive(Debug, Clone)]
pub struct NewKey {
    /// `key_` and 12 hex digits.
    pub id: String,
    /// The secret the client sends (`X-API-KEY`).
    pub key: String,
}

/// Whether `key` has the shape of a key this module makes (so that one that does not is refused
/// without a lookup).
pub fn is_well_formed(key: &str) -> bool {
    key.strip_prefix(KEY_PREFIX).is_some_and(|rest| rest.len() == 48 && rest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// The SHA-256 of a key, hex: what the table stores and looks up.
pub fn fingerprint(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Handle on the `api_keys` table (service role).
#[derive(Clone)]
pub struct ApiKeys {
    pool: PgPool,
}

impl ApiKeys {
    /// Wrap a pool of the service role.
    pub fn new(pool: PgPool) -> Self {
        ApiKeys { pool }
    }

    /// Make a key for `tenant`, which must exist (`sandcell-admin tenant create`).
    pub async fn create(&self, tenant: &str) -> Result<NewKey> {
        let key = NewKey { id: format!("key_{}", random_hex(12)), key: format!("{KEY_PREFIX}{}", random_hex(48)) };
        let exists: Option<(String,)> =
            sqlx::query_as("SELECT tenant FROM tenants WHERE tenant = $1").bind(tenant).fetch_optional(&self.pool).await.context("looking up the tenant")?;
        if exists.is_none() {
            anyhow::bail!("no tenant {tenant:?}: create it first with `sandcell-admin tenant create {tenant}`");
        }
        sqlx::query("INSERT INTO api_keys (key_id, tenant, key_sha256) VALUES ($1, $2, $3)")
            .bind(&key.id)
            .bind(tenant)
            .bind(fingerprint(&key.key))
            .execute(&self.pool)
            .await
            .context("storing the API key")?;
        Ok(key)
    }

    /// Revoke a key by id; false when no live key has that id.
    pub async fn revoke(&self, key_id: &str) -> Result<bool> {
        let done = sqlx::query("UPDATE api_keys SET revoked_at = now() WHERE key_id = $1 AND revoked_at IS NULL")
            .bind(key_id)
            .execute(&self.pool)
            .await
            .context("revoking the API key")?;
        Ok(done.rows_affected() == 1)
    }

    /// The tenant and key id a live key belongs to; `None` for an unknown or revoked key.
    pub async fn tenant_of(&self, key: &str) -> Result<Option<(String, String)>> {
        if !is_well_formed(key) {
            return Ok(None);
        }
        sqlx::query_as("SELECT tenant, key_id FROM api_keys WHERE key_sha256 = $1 AND revoked_at IS NULL")
            .bind(fingerprint(key))
            .fetch_optional(&self.pool)
            .await
            .context("looking up the API key")
    }

    /// Every key of `tenant`: id, created, revoked (never the secret).
    pub async fn list(&self, tenant: &str) -> Result<Vec<(String, chrono::DateTime<chrono::Utc>, Option<chrono::DateTime<chrono::Utc>>)>> {
        sqlx::query_as("SELECT key_id, created_at, revoked_at FROM api_keys WHERE tenant = $1 ORDER BY created_at")
            .bind(tenant)
            .fetch_all(&self.pool)
            .await
            .context("listing API keys")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_shape_of_a_made_key_is_well_formed() {
        let made = format!("{KEY_PREFIX}{}", random_hex(48));
        assert!(is_well_formed(&made));
        assert!(!is_well_formed(&made[..made.len() - 1]));
        assert!(!is_well_formed(&format!("{made}0")));
        assert!(!is_well_formed(&made.to_uppercase()));
        assert!(!is_well_formed("sk_sandcell_healthcheck"));
    }

    #[test]
    fn fingerprint_is_the_sha256_of_the_key_in_hex() {
        assert_eq!(fingerprint("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
