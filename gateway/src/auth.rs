//! Who is calling: an API key names a tenant (control plane), a sandbox's access token names
//! one sandbox (the sandbox's own ports). The two extractors here are the only way a handler
//! learns a tenant, so no handler can serve a request it has not authenticated.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use hmac::{Hmac, Mac};
use sandcell_core::api_keys::{fingerprint, ApiKeys};
use sha2::Sha256;

use crate::error::ApiError;
use crate::sandboxes::SandboxRow;
use crate::Gateway;

/// Most answers the key cache holds.
const KEY_CACHE_MAX: usize = 10_000;

/// API keys to tenants, each lookup reused for a short while (`SANDCELL_GATEWAY_KEY_CACHE_S`).
pub struct Keys {
    store: ApiKeys,
    ttl: Duration,
    /// Key fingerprint → (when looked up, its tenant or `None` for a refused key).
    cache: Mutex<HashMap<String, (Instant, Option<String>)>>,
}

impl Keys {
    /// Look keys up in `store`, caching each answer for `ttl`.
    pub fn new(store: ApiKeys, ttl: Duration) -> Self {
        Keys { store, ttl, cache: Mutex::new(HashMap::new()) }
    }

    /// The tenant of a live key; `None` for an unknown or revoked one.
    pub async fn tenant(&self, key: &str) -> anyhow::Result<Option<String>> {
        if !sandcell_core::api_keys::is_well_formed(key) {
            return Ok(None);
        }
        let fp = fingerprint(key);
        if let Ok(cache) = self.cache.lock() {
            if let Some((at, tenant)) = cache.get(&fp) {
                if at.elapsed() < self.ttl {
                    return Ok(tenant.clone());
                }
            }
        }
        let tenant = self.store.tenant_of(key).await?.map(|(tenant, _)| tenant);
        if let Ok(mut cache) = self.cache.lock() {
            // Bounded: a flood of made-up keys must not grow it without end, nor push the live
            // keys out — expired answers go first, then refusals.
            if cache.len() >= KEY_CACHE_MAX {
                let ttl = self.ttl;
                cache.retain(|_, (at, _)| at.elapsed() < ttl);
            }
            if cache.len() >= KEY_CACHE_MAX {
                cache.retain(|_, (_, tenant)| tenant.is_some());
            }
            if cache.len() >= KEY_CACHE_MAX {
                cache.clear();
            }
            cache.insert(fp, (Instant::now(), tenant.clone()));
        }
        Ok(tenant)
    }
}

/// The access token of each sandbox: HMAC-SHA256 of its id under the gateway's secret. Returned
/// as `envdAccessToken` and `trafficAccessToken` when a sandbox is created or connected to; the
/// SDK sends it on every call to the sandbox (`X-Access-Token` / `E2B-Traffic-Access-Token`).
/// Nothing is stored: a token is checked by computing it again.
pub struct Tokens {
    secret: Vec<u8>,
}

impl Tokens {
    /// Tokens signed with `secret`.
    pub fn new(secret: Vec<u8>) -> Self {
        Tokens { secret }
    }

    fn mac(&self, sandbox_id: &str) -> Hmac<Sha256> {
        // HMAC accepts a key of any length; `new_from_slice` cannot fail for it.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret).unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(sandbox_id.as_bytes());
        mac
    }

    /// The token of `sandbox_id`.
    pub fn token(&self, sandbox_id: &str) -> String {
        hex::encode(self.mac(sandbox_id).finalize().into_bytes())
    }

    /// Whether `presented` is the token of `sandbox_id` (in constant time).
    pub fn verify(&self, sandbox_id: &str, presented: &str) -> bool {
        match hex::decode(presented) {
            Ok(raw) => self.mac(sandbox_id).verify_slice(&raw).is_ok(),
            Err(_) => false,
        }
    }
}

fn header<'a>(parts: &'a Parts, name: &str) -> Option<&'a str> {
    parts.headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
}

/// A control-plane caller: the tenant its `X-API-KEY` belongs to.
pub struct Caller {
    /// The tenant.
    pub tenant: String,
}

impl FromRequestParts<Arc<Gateway>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, gw: &Arc<Gateway>) -> Result<Self, ApiError> {
        Caller::identify(parts, gw).await.map_err(ApiError::before_body)
    }
}

impl Caller {
    async fn identify(parts: &Parts, gw: &Arc<Gateway>) -> Result<Self, ApiError> {
        let Some(key) = header(parts, "x-api-key") else {
            gw.metrics.auth_refused.with_label_values(&["no_key"]).inc();
            return Err(ApiError::unauthorized("no API key: set E2B_API_KEY to a key made by `sandcell-admin key create`"));
        };
        match gw.keys.tenant(key).await {
            Ok(Some(tenant)) => Ok(Caller { tenant }),
            Ok(None) => {
                gw.metrics.auth_refused.with_label_values(&["bad_key"]).inc();
                Err(ApiError::unauthorized("invalid API key"))
            }
            Err(e) => Err(ApiError::internal("checking the API key", &e)),
        }
    }
}

/// A caller of a sandbox's own ports (envd, the code interpreter): the sandbox named by
/// `E2b-Sandbox-Id`, proven by its access token.
pub struct SandboxCaller {
    /// The sandbox, with its tenant.
    pub sandbox: SandboxRow,
}

impl FromRequestParts<Arc<Gateway>> for SandboxCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, gw: &Arc<Gateway>) -> Result<Self, ApiError> {
        SandboxCaller::identify(parts, gw).await.map_err(ApiError::before_body)
    }
}

impl SandboxCaller {
    async fn identify(parts: &Parts, gw: &Arc<Gateway>) -> Result<Self, ApiError> {
        let Some(id) = header(parts, "e2b-sandbox-id") else {
            return Err(ApiError::bad_request("no E2b-Sandbox-Id header: point E2B_SANDBOX_URL at the gateway"));
        };
        let token = header(parts, "x-access-token").or_else(|| header(parts, "e2b-traffic-access-token"));
        if !token.is_some_and(|t| gw.tokens.verify(id, t)) {
            gw.metrics.auth_refused.with_label_values(&["bad_sandbox_token"]).inc();
            return Err(ApiError::unauthorized("missing or wrong access token for this sandbox"));
        }
        match gw.sandboxes.row(id).await {
            Ok(Some(sandbox)) => Ok(SandboxCaller { sandbox }),
            Ok(None) => Err(ApiError::sandbox_not_found(id)),
            Err(e) => Err(ApiError::internal("looking up the sandbox", &e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_verifies_for_its_sandbox_only_and_under_its_secret_only() {
        let tokens = Tokens::new(b"secret-one".to_vec());
        let t = tokens.token("ses_a");
        assert_eq!(t.len(), 64);
        assert!(tokens.verify("ses_a", &t));
        assert!(!tokens.verify("ses_b", &t));
        assert!(!tokens.verify("ses_a", "not hex"));
        assert!(!tokens.verify("ses_a", &t[..62]));
        assert!(!Tokens::new(b"secret-two".to_vec()).verify("ses_a", &t));
    }
}
