//! Tenants: their quotas, their database roles, and their artifact reservations.
//!
//! The owner of per-tenant limits as stored. The admission check every submission passes runs
//! inside the one statement that records a job (the SQL function `sandcell_record_job`,
//! migrations/0012_record_job.sql and 0014_record_job_routes.sql, called by
//! [`crate::jobs::JobStore::record_queued`]); the worker calls
//! [`TenantStore::reserve_artifact_bytes`] before it stores files, and `sandcell-admin` calls
//! [`TenantStore::create`] to give a tenant its own database role.
//! Row-level security on the tables (migrations/0003_tenants.sql) is what keeps one tenant's
//! rows from another's role; this module only creates the roles the policies name.

use anyhow::{bail, Context, Result};
use sqlx::postgres::PgPool;
use sqlx::{Postgres, Row, Transaction};

use crate::config::parse_or;

/// The group role every tenant's login role belongs to (the policies are written for it).
pub const TENANT_GROUP_ROLE: &str = "sandcell_tenant";
/// Prefix of tenants' login roles (followed by 16 hex digits).
const TENANT_ROLE_PREFIX: &str = "sandcell_t_";
/// A tenant login's name, as a Postgres regular expression ([`is_tenant_role`]).
const TENANT_ROLE_PATTERN: &str = "^sandcell_t_[0-9a-f]{16}$";

/// A tenant's quotas. Over any of them, a submission is `rejected` with `quota_exceeded`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quotas {
    /// Sessions `starting` or `active` at once.
    pub max_sessions: u32,
    /// Jobs `queued` or `running` at once.
    pub max_queued_jobs: u32,
    /// Bytes of artifacts still available in the store.
    pub max_artifact_bytes: u64,
    /// Jobs of the shared queue (one-off, or opening a session) dispatched and unfinished at
    /// once; more are held in Postgres and dispatched as these finish (fair share).
    pub max_jobs_in_flight: u32,
    /// Bytes of its job rows and upload answers Postgres keeps (results, refusals, execution
    /// jobs kept for its sessions, upload grants, the E2B gateway's metadata and `envVars` of its
    /// sandboxes), until the retention deletes them (migrations 0022, 0027, 0028).
    pub max_result_bytes: u64,
    /// Connections its database login may hold open at once (the role's `CONNECTION LIMIT`,
    /// which Postgres enforces; migration 0029): a tenant opening connections must not take
    /// the ones every service needs.
    pub max_db_connections: u32,
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas {
            max_sessions: 20,
            max_queued_jobs: 1000,
            max_artifact_bytes: 5 * 1024 * 1024 * 1024,
            max_jobs_in_flight: 4,
            max_result_bytes: 2 * 1024 * 1024 * 1024,
            max_db_connections: 16,
        }
    }
}

impl Quotas {
    /// The quotas of a `tenants` row (its columns by name).
    fn from_row(r: &sqlx::postgres::PgRow) -> Result<Self> {
        Ok(Quotas {
            max_sessions: u32::try_from(r.try_get::<i32, _>("max_sessions")?).unwrap_or(0),
            max_queued_jobs: u32::try_from(r.try_get::<i32, _>("max_queued_jobs")?).unwrap_or(0),
            max_artifact_bytes: u64::try_from(r.try_get::<i64, _>("max_artifact_bytes")?).unwrap_or(0),
            max_jobs_in_flight: u32::try_from(r.try_get::<i32, _>("max_jobs_in_flight")?).unwrap_or(1),
            max_result_bytes: u64::try_from(r.try_get::<i64, _>("max_result_bytes")?).unwrap_or(0),
            max_db_connections: u32::try_from(r.try_get::<i32, _>("max_db_connections")?).unwrap_or(1),
        })
    }

    /// The operator's defaults for new tenants: `SANDCELL_DEFAULT_MAX_SESSIONS` (20),
    /// `SANDCELL_DEFAULT_MAX_QUEUED_JOBS` (1000), `SANDCELL_DEFAULT_MAX_ARTIFACT_BYTES` (5 GiB),
    /// `SANDCELL_DEFAULT_MAX_JOBS_IN_FLIGHT` (4), `SANDCELL_DEFAULT_MAX_RESULT_BYTES` (2 GiB),
    /// `SANDCELL_DEFAULT_MAX_DB_CONNECTIONS` (16).
    pub fn from_env() -> Result<Self> {
        let d = Quotas::default();
        Ok(Quotas {
            max_sessions: parse_or("SANDCELL_DEFAULT_MAX_SESSIONS", d.max_sessions)?,
            max_queued_jobs: parse_or("SANDCELL_DEFAULT_MAX_QUEUED_JOBS", d.max_queued_jobs)?,
            max_artifact_bytes: parse_or("SANDCELL_DEFAULT_MAX_ARTIFACT_BYTES", d.max_artifact_bytes)?,
            max_jobs_in_flight: parse_or("SANDCELL_DEFAULT_MAX_JOBS_IN_FLIGHT", d.max_jobs_in_flight)?.max(1),
            max_result_bytes: parse_or("SANDCELL_DEFAULT_MAX_RESULT_BYTES", d.max_result_bytes)?.max(1),
            max_db_connections: parse_or("SANDCELL_DEFAULT_MAX_DB_CONNECTIONS", d.max_db_connections)?.max(1),
        })
    }
}

/// Register `tenant` with `defaults` unless it already has a row. Every job row's tenant has a
/// tenant row (its notification channel lives there).
pub async fn ensure(tx: &mut Transaction<'_, Postgres>, tenant: &str, defaults: &Quotas) -> Result<()> {
    sqlx::query(
        "INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes, max_jobs_in_flight, max_result_bytes, max_db_connections)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (tenant) DO NOTHING",
    )
    .bind(tenant)
    .bind(i32::try_from(defaults.max_sessions).unwrap_or(i32::MAX))
    .bind(i32::try_from(defaults.max_queued_jobs).unwrap_or(i32::MAX))
    .bind(i64::try_from(defaults.max_artifact_bytes).unwrap_or(i64::MAX))
    .bind(i32::try_from(defaults.max_jobs_in_flight.max(1)).unwrap_or(i32::MAX))
    .bind(i64::try_from(defaults.max_result_bytes.max(1)).unwrap_or(i64::MAX))
    .bind(db_connections(defaults))
    .execute(&mut **tx)
    .await
    .with_context(|| format!("registering tenant {tenant}"))?;
    Ok(())
}

/// A tenant's database login, as `sandcell-admin tenant create` hands it out.
#[derive(Debug, Clone)]
pub struct DbLogin {
    /// Role name (opaque: `sandcell_t_` and 16 hex digits).
    pub role: String,
    /// Its password.
    pub password: String,
}

/// A random lowercase hex string of `n` (≤ 64) digits, from the OS's CSPRNG (via uuid v4).
pub fn random_hex(n: usize) -> String {
    let mut s = String::with_capacity(64);
    s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    s.truncate(n.min(64));
    s
}

/// Handle on the tenants table, for administration and the worker's artifact quota.
#[derive(Clone)]
pub struct TenantStore {
    pool: PgPool,
}

impl TenantStore {
    /// Wrap a pool (of the service role, which owns the tables).
    pub fn new(pool: PgPool) -> Self {
        TenantStore { pool }
    }

    /// Create `tenant` (or update its quotas) and give it a fresh database login that can read
    /// only its own rows. An existing login of the tenant keeps working only if `rotate` is
    /// false; with `rotate` the old role is dropped.
    pub async fn create(&self, tenant: &str, quotas: &Quotas, rotate: bool) -> Result<DbLogin> {
        if !sandcell_protocol::submission::is_valid_tenant(tenant) {
            bail!("tenant must be 1-64 characters of [a-z0-9_-], got {tenant:?}");
        }
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        ensure(&mut tx, tenant, quotas).await?;
        self.set_quotas_in(&mut tx, tenant, quotas).await?;
        let old: Option<String> = sqlx::query_scalar("SELECT db_role FROM tenants WHERE tenant = $1 FOR UPDATE")
            .bind(tenant)
            .fetch_one(&mut *tx)
            .await
            .context("reading the tenant's role")?;
        let login = DbLogin { role: format!("{TENANT_ROLE_PREFIX}{}", random_hex(16)), password: random_hex(40) };
        // Role names and passwords are generated hex, so formatting them into DDL is safe
        // (utility statements take no bind parameters).
        let ddl =
            format!("CREATE ROLE {} LOGIN PASSWORD '{}' CONNECTION LIMIT {} IN ROLE {TENANT_GROUP_ROLE}", login.role, login.password, db_connections(quotas));
        sqlx::query(sqlx::AssertSqlSafe(ddl)).execute(&mut *tx).await.context("creating the tenant's role")?;
        sqlx::query("UPDATE tenants SET db_role = $2 WHERE tenant = $1")
            .bind(tenant)
            .bind(&login.role)
            .execute(&mut *tx)
            .await
            .context("recording the tenant's role")?;
        if let (Some(old), true) = (old, rotate) {
            if is_tenant_role(&old) {
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {old}"))).execute(&mut *tx).await.context("dropping the old role")?;
            }
        }
        tx.commit().await.context("committing tenant")?;
        Ok(login)
    }

    /// Change a tenant's quotas (registering it if needed).
    pub async fn set_quotas(&self, tenant: &str, quotas: &Quotas) -> Result<()> {
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        ensure(&mut tx, tenant, quotas).await?;
        self.set_quotas_in(&mut tx, tenant, quotas).await?;
        tx.commit().await.context("committing quotas")
    }

    async fn set_quotas_in(&self, tx: &mut Transaction<'_, Postgres>, tenant: &str, q: &Quotas) -> Result<()> {
        let role: Option<String> = sqlx::query_scalar(
            "UPDATE tenants SET max_sessions = $2, max_queued_jobs = $3, max_artifact_bytes = $4, max_jobs_in_flight = $5, max_result_bytes = $6,
                    max_db_connections = $7
             WHERE tenant = $1
             RETURNING db_role",
        )
        .bind(tenant)
        .bind(i32::try_from(q.max_sessions).unwrap_or(i32::MAX))
        .bind(i32::try_from(q.max_queued_jobs).unwrap_or(i32::MAX))
        .bind(i64::try_from(q.max_artifact_bytes).unwrap_or(i64::MAX))
        .bind(i32::try_from(q.max_jobs_in_flight.max(1)).unwrap_or(i32::MAX))
        .bind(i64::try_from(q.max_result_bytes.max(1)).unwrap_or(i64::MAX))
        .bind(db_connections(q))
        .fetch_optional(&mut **tx)
        .await
        .context("updating quotas")?
        .flatten();
        if let Some(role) = role.filter(|r| is_tenant_role(r)) {
            // The role name is generated hex and the limit a number (no bind parameters in DDL).
            let ddl = format!("ALTER ROLE {role} CONNECTION LIMIT {}", db_connections(q));
            sqlx::query(sqlx::AssertSqlSafe(ddl)).execute(&mut **tx).await.context("setting the tenant's connection limit")?;
        }
        Ok(())
    }

    /// Every registered tenant, by name: its quotas and whether it has a database login.
    pub async fn list(&self) -> Result<Vec<(String, Quotas, bool)>> {
        let rows = sqlx::query(
            "SELECT tenant, max_sessions, max_queued_jobs, max_artifact_bytes, max_jobs_in_flight, db_role IS NOT NULL, max_result_bytes,
                    max_db_connections
             FROM tenants ORDER BY tenant",
        )
        .fetch_all(&self.pool)
        .await
        .context("listing tenants")?;
        rows.iter().map(|r| Ok((r.try_get(0)?, Quotas::from_row(r)?, r.try_get(5)?))).collect()
    }

    /// Take a tenant's database login away (its role is dropped) and set its session and job
    /// quotas to zero, so no job of it is admitted again, even from a trusted backend. Its rows
    /// and artifacts stay (history; artifacts expire on their TTL). Whether the tenant existed.
    pub async fn revoke(&self, tenant: &str) -> Result<bool> {
        let mut tx = self.pool.begin().await.context("beginning transaction")?;
        let Some(role) = sqlx::query_scalar::<_, Option<String>>("SELECT db_role FROM tenants WHERE tenant = $1 FOR UPDATE")
            .bind(tenant)
            .fetch_optional(&mut *tx)
            .await
            .context("reading the tenant's role")?
        else {
            return Ok(false);
        };
        if let Some(role) = role.filter(|r| is_tenant_role(r)) {
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}"))).execute(&mut *tx).await.context("dropping the tenant's role")?;
        }
        sqlx::query("UPDATE tenants SET db_role = NULL, max_sessions = 0, max_queued_jobs = 0 WHERE tenant = $1")
            .bind(tenant)
            .execute(&mut *tx)
            .await
            .context("revoking the tenant")?;
        tx.commit().await.context("committing the revocation")?;
        Ok(true)
    }

    /// The tenant's quotas, if it is registered.
    pub async fn quotas(&self, tenant: &str) -> Result<Option<Quotas>> {
        let row = sqlx::query(
            "SELECT max_sessions, max_queued_jobs, max_artifact_bytes, max_jobs_in_flight, max_result_bytes, max_db_connections FROM tenants WHERE tenant = $1",
        )
        .bind(tenant)
        .fetch_optional(&self.pool)
        .await
        .context("reading quotas")?;
        row.as_ref().map(Quotas::from_row).transpose()
    }

    /// Reserve for `job_id` the artifact bytes it may store, at most `wanted`, and return them
    /// (0 when the tenant is at its quota; `wanted` for a tenant with no row). Under the
    /// tenant's row lock, what it stores ([`stored_bytes`]: its artifacts, what its other
    /// running jobs reserved, what its live upload grants allow) never exceeds
    /// `max_artifact_bytes`, so jobs committing and uploads granted at the same moment cannot
    /// together overshoot. [`crate::jobs::JobStore::finish`] deletes the reservation when it records the
    /// artifacts; a reservation of a job that is no longer running counts for nothing. Calling
    /// it again for the same job (a rerun) replaces the reservation.
    pub async fn reserve_artifact_bytes(&self, tenant: &str, job_id: &str, wanted: u64) -> Result<u64> {
        let mut tx = self.pool.begin().await.context("beginning reservation")?;
        let Some(max) = lock_stored_bytes_quota(&mut tx, tenant).await? else {
            return Ok(wanted);
        };
        let used = stored_bytes(&mut tx, tenant, Some(job_id)).await?;
        let left = u64::try_from(max.saturating_sub(used)).unwrap_or(0);
        let granted = wanted.min(left);
        sqlx::query(
            "INSERT INTO artifact_reservations (tenant, job_id, bytes) VALUES ($1, $2, $3)
             ON CONFLICT (tenant, job_id) DO UPDATE SET bytes = EXCLUDED.bytes, reserved_at = now()",
        )
        .bind(tenant)
        .bind(job_id)
        .bind(i64::try_from(granted).unwrap_or(i64::MAX))
        .execute(&mut *tx)
        .await
        .context("recording the reservation")?;
        tx.commit().await.context("committing the reservation")?;
        Ok(granted)
    }
}

/// How many refusals of a tenant over its `max_result_bytes` are kept, of jobs and of upload
/// requests each, the newest (older ones are deleted as each new one is recorded, by
/// `JobStore::record_rejection` and `uploads`): a tenant over that quota, whose every submission
/// is refused, must not grow the database all tenants share at the intake's rate. Enough for a
/// client to read the answers to its latest submissions.
pub const KEPT_REFUSALS_OVER_QUOTA: i64 = 1000;

/// Take `tenant`'s row lock, under which its stored bytes are counted and added to, and return
/// its stored-bytes quota (`max_artifact_bytes`); `None` for a tenant with no row (no quota).
pub(crate) async fn lock_stored_bytes_quota(tx: &mut Transaction<'_, Postgres>, tenant: &str) -> Result<Option<i64>> {
    sqlx::query_scalar("SELECT max_artifact_bytes FROM tenants WHERE tenant = $1 FOR UPDATE")
        .bind(tenant)
        .fetch_optional(&mut **tx)
        .await
        .context("locking the tenant")
}

/// What counts against `tenant`'s stored-bytes quota: its available artifacts (the bytes
/// `tenant_artifact_bytes` keeps, migration 0018), the reservations of its running jobs but
/// `except_job`'s, and the bytes its upload grants let it put whose objects are not removed yet
/// (the bytes `tenant_upload_bytes` keeps, migration 0030). The one sum of a tenant's footprint in
/// the store, `sandcell_stored_bytes`, read under the lock of [`lock_stored_bytes_quota`]: kept
/// figures, so that neither a tenant's artifacts nor its live grants weigh on its next grant or
/// reservation.
pub(crate) async fn stored_bytes(tx: &mut Transaction<'_, Postgres>, tenant: &str, except_job: Option<&str>) -> Result<i64> {
    sqlx::query_scalar("SELECT sandcell_stored_bytes($1, $2)")
        .bind(tenant)
        .bind(except_job)
        .fetch_one(&mut **tx)
        .await
        .context("summing the tenant's stored, reserved and uploadable bytes")
}

/// The built-in functions no tenant login may execute, as `deploy/postgres/lockdown.sql` (a
/// superuser's step; it says why) takes them from PUBLIC: every advisory lock (a tenant's
/// ~12,000 filled Postgres' shared lock table and every new connection failed; one in the
/// schedulers' classes took intake partitions from them), every way to create a large object
/// (disk outside every quota), and `pg_get_object_address` (a lock on every object it is asked
/// about: the lock table again).
pub const KEPT_FROM_TENANTS: [&str; 20] = [
    "pg_advisory_lock(bigint)",
    "pg_advisory_lock(integer,integer)",
    "pg_advisory_lock_shared(bigint)",
    "pg_advisory_lock_shared(integer,integer)",
    "pg_try_advisory_lock(bigint)",
    "pg_try_advisory_lock(integer,integer)",
    "pg_try_advisory_lock_shared(bigint)",
    "pg_try_advisory_lock_shared(integer,integer)",
    "pg_advisory_xact_lock(bigint)",
    "pg_advisory_xact_lock(integer,integer)",
    "pg_advisory_xact_lock_shared(bigint)",
    "pg_advisory_xact_lock_shared(integer,integer)",
    "pg_try_advisory_xact_lock(bigint)",
    "pg_try_advisory_xact_lock(integer,integer)",
    "pg_try_advisory_xact_lock_shared(bigint)",
    "pg_try_advisory_xact_lock_shared(integer,integer)",
    "lo_creat(integer)",
    "lo_create(oid)",
    "lo_from_bytea(oid,bytea)",
    "pg_get_object_address(text,text[],text[])",
];

/// What `deploy/postgres/lockdown.sql` would still change in this database (empty once it was
/// applied): each of [`KEPT_FROM_TENANTS`] tenants' logins can still execute,
/// `pg_read_all_stats` and `pg_signal_backend` if this role may not see or end tenants'
/// sessions ([`sessions_holding`], [`end_tenant_session`]), and `temp_file_limit` if the
/// database sets none.
pub async fn lockdown_missing(pool: &PgPool) -> Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT f FROM unnest($1::text[]) f WHERE has_function_privilege($2, 'pg_catalog.' || f, 'EXECUTE')
         UNION ALL SELECT r FROM unnest(ARRAY['pg_read_all_stats', 'pg_signal_backend']) r WHERE NOT pg_has_role(r, 'MEMBER')
         UNION ALL SELECT 'temp_file_limit' WHERE NOT EXISTS (
             SELECT 1 FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase
              WHERE d.datname = current_database() AND s.setrole = 0 AND s.setconfig::text LIKE '%temp_file_limit=%')
         ORDER BY 1",
    )
    .bind(&KEPT_FROM_TENANTS[..])
    .bind(TENANT_GROUP_ROLE)
    .fetch_all(pool)
    .await
    .context("checking what tenants' logins can reach")
}

/// A tenant login's database session, as [`sessions_holding`] finds it.
#[derive(Debug, Clone)]
pub struct TenantSession {
    /// Its backend's process id.
    pub pid: i32,
    /// When that backend started (with `pid`, names the session: pids are reused).
    pub started: chrono::DateTime<chrono::Utc>,
    /// The tenant's login role.
    pub role: String,
}

/// The sessions of tenants' logins in this database whose transaction began `hold` or longer
/// ago: one statement running, or many one after another, or none now (idle in it). Each holds
/// back vacuum's horizon, and a listener's place in the notification queue, which every job's
/// commit writes to. A session blocked writing to a client that does not read is one of them
/// too: Postgres sends notifications (and results) inside a transaction.
/// Only logins named as [`TenantStore::create`] names them count (superusers, sandcell's own
/// role and operators' never do). Needs `pg_read_all_stats` (`deploy/postgres/lockdown.sql`):
/// without it Postgres shows no other role's state, and nothing is found.
pub async fn sessions_holding(pool: &PgPool, hold: std::time::Duration) -> Result<Vec<TenantSession>> {
    let rows = sqlx::query(
        "SELECT a.pid, a.backend_start, a.usename::text AS role
           FROM pg_stat_activity a
          WHERE a.datname = current_database() AND a.usename ~ $2 AND a.pid <> pg_backend_pid()
            AND a.xact_start <= now() - make_interval(secs => $1)",
    )
    .bind(hold.as_secs_f64())
    .bind(TENANT_ROLE_PATTERN)
    .fetch_all(pool)
    .await
    .context("looking for tenants' sessions holding what all share")?;
    rows.iter().map(|r| Ok(TenantSession { pid: r.try_get("pid")?, started: r.try_get("backend_start")?, role: r.try_get("role")? })).collect()
}

/// End `session` (its connection closes; its transaction rolls back). Whether it was still
/// there to end. Needs `pg_signal_backend` (`deploy/postgres/lockdown.sql`).
pub async fn end_tenant_session(pool: &PgPool, session: &TenantSession) -> Result<bool> {
    let ended: Option<bool> =
        sqlx::query_scalar("SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a WHERE a.pid = $1 AND a.backend_start = $2 AND a.usename ~ $3")
            .bind(session.pid)
            .bind(session.started)
            .bind(TENANT_ROLE_PATTERN)
            .fetch_optional(pool)
            .await
            .with_context(|| format!("ending database session {} of {}", session.pid, session.role))?;
    Ok(ended.unwrap_or(false))
}

/// A tenant's connection quota as the role's limit: at least 1 (Postgres reads -1 as no limit).
fn db_connections(q: &Quotas) -> i32 {
    i32::try_from(q.max_db_connections.max(1)).unwrap_or(i32::MAX)
}

fn is_tenant_role(role: &str) -> bool {
    role.strip_prefix(TENANT_ROLE_PREFIX).is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lockdown_script_takes_every_function_the_check_looks_for() {
        let script = include_str!("../../deploy/postgres/lockdown.sql");
        for f in KEPT_FROM_TENANTS {
            assert!(script.contains(&format!("'{f}'")), "{f} is not in deploy/postgres/lockdown.sql");
        }
        let quoted = script.lines().filter(|l| !l.trim_start().starts_with("--")).flat_map(|l| l.split('\'')).filter(|w| w.ends_with(')')).count();
        assert_eq!(quoted, KEPT_FROM_TENANTS.len(), "the script names functions the check does not");
    }

    #[test]
    fn the_pattern_postgres_matches_names_the_roles_this_module_makes() {
        assert_eq!(TENANT_ROLE_PATTERN, format!("^{TENANT_ROLE_PREFIX}[0-9a-f]{{16}}$"));
        assert!(random_hex(16).bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)), "lowercase hex, as the pattern says");
    }

    #[test]
    fn generated_roles_are_recognised_and_nothing_else_is() {
        assert!(is_tenant_role(&format!("{TENANT_ROLE_PREFIX}{}", random_hex(16))));
        assert!(!is_tenant_role("sandcell"));
        assert!(!is_tenant_role("sandcell_t_x; DROP TABLE jobs"));
        assert!(!is_tenant_role("postgres"));
    }

    #[test]
    fn random_hex_has_the_asked_length_and_alphabet() {
        let h = random_hex(40);
        assert_eq!(h.len(), 40);
        assert!(h.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_ne!(random_hex(40), random_hex(40));
    }
}
