//! Tenant administration: everything a tenant needs to use sandcell on its own, created in one
//! step — a RabbitMQ user that may only publish to the intake exchange, a Postgres login role
//! that row-level security confines to the tenant's rows, and a quotas row.
//!
//! The broker side goes through RabbitMQ's management HTTP API (the plugin
//! `rabbitmq_management`, enabled by `deploy/local/up.sh` on 127.0.0.1:15672), authenticated
//! as the service user from `SANDCELL_AMQP_URL`; the database side through
//! [`sandcell_core::tenants::TenantStore`] as the service role from `SANDCELL_DATABASE_URL`.
#![warn(missing_docs)]

use anyhow::{bail, Context, Result};
use sandcell_core::broker;
use sandcell_core::tenants::{random_hex, Quotas, TenantStore};
use sqlx::PgPool;

/// Where and how to reach the services as an operator.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// `SANDCELL_AMQP_URL`: the service user (an administrator of the broker).
    pub amqp_url: String,
    /// `SANDCELL_DATABASE_URL`: the service role (owner of the tables, `CREATEROLE`).
    pub database_url: String,
    /// `SANDCELL_RABBITMQ_MANAGEMENT_URL`, default `http://127.0.0.1:15672`.
    pub management_url: String,
}

impl AdminSettings {
    /// Read the settings from the environment.
    pub fn from_env() -> Result<Self> {
        Ok(AdminSettings {
            amqp_url: sandcell_core::config::var_required("SANDCELL_AMQP_URL")?,
            database_url: sandcell_core::config::var_required("SANDCELL_DATABASE_URL")?,
            management_url: sandcell_core::config::var_or("SANDCELL_RABBITMQ_MANAGEMENT_URL", "http://127.0.0.1:15672"),
        })
    }
}

/// What a tenant is handed: its own connection URLs (same hosts as the service's).
#[derive(Debug, Clone)]
pub struct TenantCredentials {
    /// The tenant's name (also its broker user).
    pub tenant: String,
    /// `amqp://<tenant>:<password>@host/vhost`.
    pub amqp_url: String,
    /// `postgres://<role>:<password>@host/db`.
    pub database_url: String,
}

/// Operator handle.
pub struct Admin {
    settings: AdminSettings,
    pool: PgPool,
    http: reqwest::Client,
}

impl Admin {
    /// Connect to Postgres (applying migrations, so the policies exist) as the service role.
    pub async fn connect(settings: AdminSettings) -> Result<Self> {
        let pool = sandcell_core::jobs::connect(&settings.database_url, 2).await?;
        let http = reqwest::Client::builder().timeout(std::time::Duration::from_secs(10)).build().context("building HTTP client")?;
        Ok(Admin { settings, pool, http })
    }

    /// Create `tenant` — or, if it exists, give it new credentials (the old broker password and
    /// database role stop working) — with `quotas`.
    pub async fn create_tenant(&self, tenant: &str, quotas: &Quotas) -> Result<TenantCredentials> {
        if !sandcell_protocol::submission::is_valid_tenant(tenant) {
            bail!("tenant must be 1-64 characters of [a-z0-9_-], got {tenant:?}");
        }
        let service_user = broker::url_user(&self.settings.amqp_url).unwrap_or_default();
        if tenant == service_user {
            bail!("{tenant:?} is the service's own broker user");
        }
        let broker_password = random_hex(40);
        self.put_broker_user(tenant, &broker_password).await?;
        let login = TenantStore::new(self.pool.clone()).create(tenant, quotas, true).await?;
        Ok(TenantCredentials {
            tenant: tenant.to_string(),
            amqp_url: replace_userinfo(&self.settings.amqp_url, tenant, &broker_password)?,
            database_url: replace_userinfo(&self.settings.database_url, &login.role, &login.password)?,
        })
    }

    /// Change a tenant's quotas.
    pub async fn set_quotas(&self, tenant: &str, quotas: &Quotas) -> Result<()> {
        TenantStore::new(self.pool.clone()).set_quotas(tenant, quotas).await
    }

    /// A tenant's quotas, if registered.
    pub async fn quotas(&self, tenant: &str) -> Result<Option<Quotas>> {
        TenantStore::new(self.pool.clone()).quotas(tenant).await
    }

    async fn put_broker_user(&self, user: &str, password: &str) -> Result<()> {
        let uri: lapin::uri::AMQPUri = self.settings.amqp_url.parse().map_err(|e| anyhow::anyhow!("parsing SANDCELL_AMQP_URL: {e}"))?;
        let (admin, admin_pw) = (&uri.authority.userinfo.username, &uri.authority.userinfo.password);
        let vhost = encode_component(&uri.vhost);
        let base = self.settings.management_url.trim_end_matches('/');
        let (configure, write, read) = broker::TENANT_PERMISSIONS;
        let calls = [
            (format!("{base}/api/users/{user}"), serde_json::json!({"password": password, "tags": ""})),
            (format!("{base}/api/permissions/{vhost}/{user}"), serde_json::json!({"configure": configure, "write": write, "read": read})),
        ];
        for (url, body) in calls {
            let resp = self
                .http
                .put(&url)
                .basic_auth(admin, Some(admin_pw))
                .json(&body)
                .send()
                .await
                .with_context(|| format!("calling the RabbitMQ management API at {base} (is rabbitmq_management enabled?)"))?;
            if !resp.status().is_success() {
                let status = resp.status();
                let text = resp.text().await.unwrap_or_default();
                bail!("RabbitMQ management API: PUT {} answered {status}: {text}", url.replace(base, ""));
            }
        }
        Ok(())
    }
}

/// `url` with its user and password replaced (both are `[a-z0-9_-]`, no escaping needed).
fn replace_userinfo(url: &str, user: &str, password: &str) -> Result<String> {
    let scheme_end = url.find("://").context("URL has no scheme")? + 3;
    let host_start = url.rfind('@').map_or(scheme_end, |at| at + 1);
    Ok(format!("{}{user}:{password}@{}", &url[..scheme_end], &url[host_start..]))
}

/// Percent-encode a path component (the vhost `/` is `%2F`).
fn encode_component(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_keep_the_services_host_and_path() {
        assert_eq!(replace_userinfo("amqp://sandcell:pw@127.0.0.1:5672/%2f", "acme", "s3cret").unwrap(), "amqp://acme:s3cret@127.0.0.1:5672/%2f");
        assert_eq!(replace_userinfo("postgres://127.0.0.1/sandcell", "r", "p").unwrap(), "postgres://r:p@127.0.0.1/sandcell");
    }

    #[test]
    fn the_default_vhost_is_encoded() {
        assert_eq!(encode_component("/"), "%2F");
        assert_eq!(encode_component("prod"), "prod");
    }
}
