//! The sandboxes the gateway opened (`gateway_sandboxes`): what E2B's API reports about a
//! sandbox that a sandcell session does not hold — its template, the caller's metadata, its
//! container's shape. Whether a sandbox runs is always its session's state, never this table's.

use std::collections::HashMap;
use std::sync::Mutex;

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// Most contexts a sandbox may have besides its default one (each is a namespace in its
/// kernel's memory).
pub const MAX_CONTEXTS: i64 = 64;

/// One sandbox the gateway opened.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct SandboxRow {
    /// The sandcell session id, which is the E2B sandbox id.
    pub session_id: String,
    /// Its tenant (the API key's).
    pub tenant: String,
    /// The template named at creation.
    pub template_id: String,
    /// The caller's metadata (string → string).
    pub metadata: serde_json::Value,
    /// The container's CPU quota, rounded up to whole CPUs.
    pub cpu_count: i32,
    /// The container's memory limit.
    pub memory_mb: i32,
    /// The workspace's size.
    pub disk_mb: i32,
    /// Variables every run and command of the sandbox sees (string → string).
    pub env: serde_json::Value,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

/// A live sandbox in a listing: its row and when its keep-alive ends.
pub struct Listed {
    /// The row.
    pub row: SandboxRow,
    /// When the session expires if nothing runs in it.
    pub expires_at: Option<DateTime<Utc>>,
}

/// The table, with rows cached by id (a row never changes once written).
pub struct Sandboxes {
    db: PgPool,
    cache: Mutex<HashMap<String, SandboxRow>>,
}

impl Sandboxes {
    /// Use `db` (the service role).
    pub fn new(db: PgPool) -> Self {
        Sandboxes { db, cache: Mutex::new(HashMap::new()) }
    }

    /// Whether Postgres answers.
    pub async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.db).await.context("Postgres does not answer")?;
        Ok(())
    }

    /// The jobs of `session_id` not yet ended (queued or running), oldest first.
    pub async fn unfinished_jobs(&self, tenant: &str, session_id: &str) -> Result<Vec<String>> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT job_id FROM jobs WHERE tenant = $1 AND session_id = $2 AND status IN ('queued', 'running') ORDER BY queued_at")
                .bind(tenant)
                .bind(session_id)
                .fetch_all(&self.db)
                .await
                .context("listing the session's unfinished jobs")?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    /// Record a sandbox just opened.
    pub async fn insert(&self, row: &SandboxRow) -> Result<()> {
        sqlx::query("INSERT INTO gateway_sandboxes (session_id, tenant, template_id, metadata, cpu_count, memory_mb, disk_mb, created_at, env) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)")
            .bind(&row.session_id)
            .bind(&row.tenant)
            .bind(&row.template_id)
            .bind(&row.metadata)
            .bind(row.cpu_count)
            .bind(row.memory_mb)
            .bind(row.disk_mb)
            .bind(row.created_at)
            .bind(&row.env)
            .execute(&self.db)
            .await
            .context("recording the sandbox")?;
        Ok(())
    }

    /// The sandbox with this id, whoever's it is (callers check the tenant).
    pub async fn row(&self, id: &str) -> Result<Option<SandboxRow>> {
        if let Some(row) = self.cache.lock().ok().and_then(|c| c.get(id).cloned()) {
            return Ok(Some(row));
        }
        let row: Option<SandboxRow> =
            sqlx::query_as("SELECT * FROM gateway_sandboxes WHERE session_id = $1").bind(id).fetch_optional(&self.db).await.context("reading the sandbox")?;
        if let (Some(row), Ok(mut cache)) = (&row, self.cache.lock()) {
            if cache.len() > 100_000 {
                cache.clear();
            }
            cache.insert(id.to_string(), row.clone());
        }
        Ok(row)
    }

    /// Forget a sandbox's cached row (it was killed: it will not be asked for often again).
    pub fn forget(&self, id: &str) {
        if let Ok(mut cache) = self.cache.lock() {
            cache.remove(id);
        }
    }

    /// `tenant`'s sandboxes whose session is live and whose metadata holds all of `metadata`,
    /// oldest first, from `offset`, at most `limit`.
    pub async fn live(&self, tenant: &str, metadata: &serde_json::Value, offset: i64, limit: i64) -> Result<Vec<Listed>> {
        #[derive(sqlx::FromRow)]
        struct Joined {
            #[sqlx(flatten)]
            row: SandboxRow,
            expires_at: Option<DateTime<Utc>>,
        }
        let rows: Vec<Joined> = sqlx::query_as(
            "SELECT g.*, s.expires_at \
             FROM gateway_sandboxes g JOIN sessions s ON s.session_id = g.session_id AND s.tenant = g.tenant \
             WHERE g.tenant = $1 AND s.state IN ('starting', 'active', 'moving') AND (s.expires_at IS NULL OR s.expires_at > now()) \
               AND g.metadata @> $4 \
             ORDER BY g.created_at, g.session_id OFFSET $2 LIMIT $3",
        )
        .bind(tenant)
        .bind(offset)
        .bind(limit)
        .bind(metadata)
        .fetch_all(&self.db)
        .await
        .context("listing sandboxes")?;
        Ok(rows.into_iter().map(|j| Listed { row: j.row, expires_at: j.expires_at }).collect())
    }

    /// Record a new context of `session_id`, whose kernel namespace is first named `context_id`;
    /// false when the sandbox has [`MAX_CONTEXTS`] already.
    pub async fn create_context(&self, session_id: &str, context_id: &str, language: &str, cwd: &str) -> Result<bool> {
        let done = sqlx::query(
            "INSERT INTO gateway_contexts (session_id, context_id, namespace, language, cwd) SELECT $1, $2, $2, $3, $4 \
             WHERE (SELECT count(*) FROM gateway_contexts WHERE session_id = $1) < $5",
        )
        .bind(session_id)
        .bind(context_id)
        .bind(language)
        .bind(cwd)
        .bind(MAX_CONTEXTS)
        .execute(&self.db)
        .await
        .context("recording the context")?;
        Ok(done.rows_affected() == 1)
    }

    /// The contexts of `session_id` besides the default one: (id, language, cwd), oldest first.
    pub async fn contexts(&self, session_id: &str) -> Result<Vec<(String, String, String)>> {
        sqlx::query_as("SELECT context_id, language, cwd FROM gateway_contexts WHERE session_id = $1 ORDER BY created_at, context_id")
            .bind(session_id)
            .fetch_all(&self.db)
            .await
            .context("listing contexts")
    }

    /// The kernel namespace of a context, if it exists.
    pub async fn namespace(&self, session_id: &str, context_id: &str) -> Result<Option<String>> {
        let row: Option<(String,)> = sqlx::query_as("SELECT namespace FROM gateway_contexts WHERE session_id = $1 AND context_id = $2")
            .bind(session_id)
            .bind(context_id)
            .fetch_optional(&self.db)
            .await
            .context("reading the context")?;
        Ok(row.map(|(n,)| n))
    }

    /// Forget a context; whether it existed.
    pub async fn delete_context(&self, session_id: &str, context_id: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM gateway_contexts WHERE session_id = $1 AND context_id = $2")
            .bind(session_id)
            .bind(context_id)
            .execute(&self.db)
            .await
            .context("deleting the context")?;
        Ok(done.rows_affected() == 1)
    }

    /// Point a context at a fresh namespace (its variables are gone for its next run); whether
    /// it existed.
    pub async fn restart_context(&self, session_id: &str, context_id: &str) -> Result<bool> {
        let fresh = format!("{context_id}-{}", sandcell_core::tenants::random_hex(8));
        let done = sqlx::query("UPDATE gateway_contexts SET namespace = $3 WHERE session_id = $1 AND context_id = $2")
            .bind(session_id)
            .bind(context_id)
            .bind(fresh)
            .execute(&self.db)
            .await
            .context("restarting the context")?;
        Ok(done.rows_affected() == 1)
    }
}
