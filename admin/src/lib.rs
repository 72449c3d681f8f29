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
        // A broker user of that name that is not a tenant's (an operator's, a monitoring tool's)
        // must not have its password and permissions replaced.
        if self.management_get(&format!("users/{tenant}")).await? && self.quotas(tenant).await?.is_none() {
            bail!("the broker already has a user {tenant:?} that is not a sandcell tenant: choose another name");
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

    /// The API keys (`sandcell-admin key ...`; the gateway's credentials).
    pub fn api_keys(&self) -> sandcell_core::api_keys::ApiKeys {
        sandcell_core::api_keys::ApiKeys::new(self.pool.clone())
    }

    /// Change a tenant's quotas.
    pub async fn set_quotas(&self, tenant: &str, quotas: &Quotas) -> Result<()> {
        TenantStore::new(self.pool.clone()).set_quotas(tenant, quotas).await
    }

    /// A tenant's quotas, if registered.
    pub async fn quotas(&self, tenant: &str) -> Result<Option<Quotas>> {
        TenantStore::new(self.pool.clone()).quotas(tenant).await
    }

    /// Every registered tenant: name, quotas, and whether it has a database login.
    pub async fn list_tenants(&self) -> Result<Vec<(String, Quotas, bool)>> {
        TenantStore::new(self.pool.clone()).list().await
    }

    /// Take `tenant`'s access away: its broker user and database login are deleted and its
    /// session and job quotas set to zero (no job of it is admitted again); its results and
    /// artifacts stay until they expire. Whether the tenant was registered.
    pub async fn delete_tenant(&self, tenant: &str) -> Result<bool> {
        if !sandcell_protocol::submission::is_valid_tenant(tenant) {
            bail!("tenant must be 1-64 characters of [a-z0-9_-], got {tenant:?}");
        }
        if broker::url_user(&self.settings.amqp_url).as_deref() == Some(tenant) {
            bail!("{tenant:?} is the service's own broker user");
        }
        self.management(reqwest::Method::DELETE, &format!("users/{tenant}"), None).await?;
        sqlx::query("UPDATE api_keys SET revoked_at = now() WHERE tenant = $1 AND revoked_at IS NULL")
            .bind(tenant)
            .execute(&self.pool)
            .await
            .context("revoking the tenant's API keys")?;
        TenantStore::new(self.pool.clone()).revoke(tenant).await
    }

    /// Set `tenant`'s broker permissions to [`broker::tenant_permissions`] and its topic
    /// permission on the events exchange, keeping its password.
    pub async fn grant_broker_permissions(&self, tenant: &str) -> Result<()> {
        if !sandcell_protocol::submission::is_valid_tenant(tenant) {
            bail!("tenant must be 1-64 characters of [a-z0-9_-], got {tenant:?}");
        }
        let (configure, write, read) = broker::tenant_permissions(tenant);
        let (exchange, topic_write, topic_read) = broker::tenant_topic_permission(tenant);
        self.put_management(&format!("permissions/{{vhost}}/{tenant}"), serde_json::json!({"configure": configure, "write": write, "read": read})).await?;
        self.put_management(
            &format!("topic-permissions/{{vhost}}/{tenant}"),
            serde_json::json!({"exchange": exchange, "write": topic_write, "read": topic_read}),
        )
        .await?;
        // What a tenant may hold on the shared broker: connections, channels, and (for every
        // tenant at once, an operator policy) the size and life of the queues it declares.
        for (limit, value) in [("max-connections", broker::TENANT_MAX_CONNECTIONS), ("max-channels", broker::TENANT_MAX_CHANNELS)] {
            self.put_management(&format!("user-limits/{tenant}/{limit}"), serde_json::json!({"value": value})).await?;
        }
        // And what any tenant can make the broker keep for operators: its dead letters.
        for (policy, pattern, definition) in broker::operator_policies() {
            self.put_management(
                &format!("operator-policies/{{vhost}}/{policy}"),
                serde_json::json!({"pattern": pattern, "definition": definition, "apply-to": "queues", "priority": 0}),
            )
            .await?;
        }
        Ok(())
    }

    async fn put_broker_user(&self, user: &str, password: &str) -> Result<()> {
        self.put_management(&format!("users/{user}"), serde_json::json!({"password": password, "tags": ""})).await?;
        self.grant_broker_permissions(user).await
    }

    /// Whether the management API has `/api/<path>`.
    async fn management_get(&self, path: &str) -> Result<bool> {
        let resp = self.management_send(reqwest::Method::GET, path, None).await?;
        match resp.status() {
            s if s.is_success() => Ok(true),
            reqwest::StatusCode::NOT_FOUND => Ok(false),
            s => bail!("RabbitMQ management API: GET /api/{path} answered {s}"),
        }
    }

    /// PUT `body` to the management API at `/api/<path>` (`{vhost}` replaced by the encoded
    /// vhost of `SANDCELL_AMQP_URL`), as the operator's broker user.
    async fn put_management(&self, path: &str, body: serde_json::Value) -> Result<()> {
        self.management(reqwest::Method::PUT, path, Some(body)).await
    }

    /// Call the management API; a DELETE of something that is not there is not an error.
    async fn management(&self, method: reqwest::Method, path: &str, body: Option<serde_json::Value>) -> Result<()> {
        let resp = self.management_send(method.clone(), path, body).await?;
        if method == reqwest::Method::DELETE && resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(());
        }
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            bail!("RabbitMQ management API: {method} /api/{path} answered {status}: {text}");
        }
        Ok(())
    }

    /// Send `method` to `/api/<path>` (`{vhost}` replaced by the encoded vhost of
    /// `SANDCELL_AMQP_URL`) as the operator's broker user.
    async fn management_send(&self, method: reqwest::Method, path: &str, body: Option<serde_json::Value>) -> Result<reqwest::Response> {
        let uri: lapin::uri::AMQPUri = self.settings.amqp_url.parse().map_err(|e| anyhow::anyhow!("parsing SANDCELL_AMQP_URL: {e}"))?;
        let (admin, admin_pw) = (&uri.authority.userinfo.username, &uri.authority.userinfo.password);
        let base = self.settings.management_url.trim_end_matches('/');
        let url = format!("{base}/api/{}", path.replace("{vhost}", &encode_component(&uri.vhost)));
        let mut req = self.http.request(method, &url).basic_auth(admin, Some(admin_pw));
        if let Some(body) = body {
            req = req.json(&body);
        }
        req.send().await.with_context(|| format!("calling the RabbitMQ management API at {base} (is rabbitmq_management enabled?)"))
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
