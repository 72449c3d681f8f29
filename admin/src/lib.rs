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
use sandcell_core::management::Management;
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
    management: Management,
}

impl Admin {
    /// Connect to Postgres (applying migrations, so the policies exist) as the service role.
    pub async fn connect(settings: AdminSettings) -> Result<Self> {
        let pool = sandcell_core::jobs::connect(&settings.database_url, 2).await?;
        let management = Management::new(&settings.management_url, &settings.amqp_url, std::time::Duration::from_secs(10))?;
        Ok(Admin { settings, pool, management })
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
        if self.management.get::<serde_json::Value>(&format!("users/{tenant}")).await?.is_some() && self.quotas(tenant).await?.is_none() {
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
        self.management.delete(&format!("users/{tenant}"), None).await?;
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
        self.management.put(&format!("permissions/{{vhost}}/{tenant}"), serde_json::json!({"configure": configure, "write": write, "read": read})).await?;
        self.management
            .put(&format!("topic-permissions/{{vhost}}/{tenant}"), serde_json::json!({"exchange": exchange, "write": topic_write, "read": topic_read}))
            .await?;
        // What a tenant may hold on the shared broker: connections, channels, and (for every
        // tenant at once, an operator policy) the size and life of the queues it declares.
        for (limit, value) in [("max-connections", broker::TENANT_MAX_CONNECTIONS), ("max-channels", broker::TENANT_MAX_CHANNELS)] {
            self.management.put(&format!("user-limits/{tenant}/{limit}"), serde_json::json!({"value": value})).await?;
        }
        // And what any tenant can make the broker keep for operators: its dead letters.
        for (policy, pattern, definition) in broker::operator_policies() {
            self.management
                .put(
                    &format!("operator-policies/{{vhost}}/{policy}"),
                    serde_json::json!({"pattern": pattern, "definition": definition, "apply-to": "queues", "priority": 0}),
                )
                .await?;
        }
        Ok(())
    }

    async fn put_broker_user(&self, user: &str, password: &str) -> Result<()> {
        self.management.put(&format!("users/{user}"), serde_json::json!({"password": password, "tags": ""})).await?;
        self.grant_broker_permissions(user).await
    }
}

/// `url` with its user and password replaced (both are `[a-z0-9_-]`, no escaping needed).
fn replace_userinfo(url: &str, user: &str, password: &str) -> Result<String> {
    let scheme_end = url.find("://").context("URL has no scheme")? + 3;
    let host_start = url.rfind('@').map_or(scheme_end, |at| at + 1);
    Ok(format!("{}{user}:{password}@{}", &url[..scheme_end], &url[host_start..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_keep_the_services_host_and_path() {
        assert_eq!(replace_userinfo("amqp://sandcell:pw@127.0.0.1:5672/%2f", "acme", "s3cret").unwrap(), "amqp://acme:s3cret@127.0.0.1:5672/%2f");
        assert_eq!(replace_userinfo("postgres://127.0.0.1/sandcell", "r", "p").unwrap(), "postgres://r:p@127.0.0.1/sandcell");
    }
}
