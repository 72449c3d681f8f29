//! The sandboxes the gateway opened (`gateway_sandboxes`): what E2B's API reports about a
//! sandbox that a sandcell session does not hold — its template, the caller's metadata, its
//! container's shape. Whether a sandbox runs is always its session's state, never this table's.

use std::collections::HashMap;
use std::sync::Mutex;

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use sqlx::PgPool;

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

    /// Record a sandbox just opened.
    pub async fn insert(&self, row: &SandboxRow) -> Result<()> {
        sqlx::query("INSERT INTO gateway_sandboxes (session_id, tenant, template_id, metadata, cpu_count, memory_mb, disk_mb, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)")
            .bind(&row.session_id)
            .bind(&row.tenant)
            .bind(&row.template_id)
            .bind(&row.metadata)
            .bind(row.cpu_count)
            .bind(row.memory_mb)
            .bind(row.disk_mb)
            .bind(row.created_at)
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

    /// `tenant`'s sandboxes whose session is live, oldest first, from `offset`, at most `limit`.
    pub async fn live(&self, tenant: &str, offset: i64, limit: i64) -> Result<Vec<Listed>> {
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
             ORDER BY g.created_at, g.session_id OFFSET $2 LIMIT $3",
        )
        .bind(tenant)
        .bind(offset)
        .bind(limit)
        .fetch_all(&self.db)
        .await
        .context("listing sandboxes")?;
        Ok(rows.into_iter().map(|j| Listed { row: j.row, expires_at: j.expires_at }).collect())
    }
}
