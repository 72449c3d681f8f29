//! The scheduler's answers to tenants' upload requests (`uploads`): written here, read by
//! clients through [`crate::reads::upload_grant`]; and how long what a grant let a tenant put
//! in the store is kept (migration 0019): its granted bytes count against the tenant's
//! stored-bytes quota until the sweeper removes its objects.

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use sandcell_protocol::upload::UploadGrant;
use sandcell_protocol::{ErrorCode, Reason};
use sqlx::postgres::PgPool;
use sqlx::Row;

use crate::tenants::{Quotas, KEPT_REFUSALS_OVER_QUOTA};

/// The answer that stands for a `(tenant, upload_id)` after [`record`] or [`grant`].
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The grant recorded first: this call's, or one recorded before it.
    pub grant: UploadGrant,
    /// Whether this call's grant was the one recorded (`false`: an earlier answer stands).
    pub inserted: bool,
}

/// Record an answer that puts nothing in the store (a refusal) unless the `(tenant,
/// upload_id)` has one: the same request asked again keeps its first answer, which is
/// returned, with whether this call recorded it.
pub async fn record(pool: &PgPool, grant: &UploadGrant) -> Result<Recorded> {
    record_many(pool, std::slice::from_ref(grant), true).await?.pop().context("an upload answer recorded without its answer")
}

/// [`record`] for each of `answers`, in one transaction: one insert statement for all of them,
/// and each tenant's old refusals past its quota forgotten once. Returned in the order given;
/// an upload id given twice is recorded once, and its later copies get the first's answer with
/// `inserted` false, as a request asked again does.
///
/// Why: a refusal recorded on its own is a transaction and a commit; a tenant's flood of upload
/// requests past its quota or invalid was answered one commit after another while other
/// tenants' requests waited behind it in the intake's partitions
/// (`scheduler::uploads::UploadRefusals` batches them).
///
/// Each row's `created_at` is the moment it is inserted (`clock_timestamp()`), not the
/// transaction's start: the newest refusals kept past the quota are counted by it, and a batch
/// of 256 sharing one moment kept up to 255 more than [`KEPT_REFUSALS_OVER_QUOTA`]. Rows are
/// inserted in (tenant, upload id) order, which breaks ties of one microsecond.
///
/// A refusal takes no tenant's row lock, but each inserted or forgotten row updates a shard of
/// its tenant's kept bytes (`tenant_job_counts`, migration 0027), which another transaction may
/// hold. With `wait_for_locks` false (a batch, which serves every tenant), the transaction waits
/// at most [`BATCH_LOCK_TIMEOUT_MS`] for any lock and fails past it, for its caller to record
/// each answer on its own.
pub async fn record_many(pool: &PgPool, answers: &[UploadGrant], wait_for_locks: bool) -> Result<Vec<Recorded>> {
    // Each (tenant, upload id) once, in a fixed order: one statement cannot insert a row twice,
    // and two batches that meet take the unique index's entries in the same order.
    let mut first: std::collections::BTreeMap<(&str, &str), usize> = std::collections::BTreeMap::new();
    for (i, a) in answers.iter().enumerate() {
        first.entry((a.tenant.as_str(), a.upload_id.as_str())).or_insert(i);
    }
    let (mut tenants, mut ids, mut docs) = (Vec::with_capacity(first.len()), Vec::with_capacity(first.len()), Vec::with_capacity(first.len()));
    for (&(tenant, id), &i) in &first {
        tenants.push(tenant);
        ids.push(id);
        docs.push(serde_json::to_value(&answers[i]).context("encoding an upload answer")?);
    }
    let mut tx = pool.begin().await.context("beginning a batch of upload answers")?;
    if !wait_for_locks {
        bound_lock_waits(&mut tx).await?;
    }
    // The no-op update makes a conflict return the standing row; `xmax = 0` holds only for a
    // row this statement inserted (an updated row carries this transaction's id in `xmax`).
    let rows = sqlx::query(
        "INSERT INTO uploads (tenant, upload_id, grant_doc, created_at)
         SELECT t, u, d, clock_timestamp() FROM unnest($1::text[], $2::text[], $3::jsonb[]) WITH ORDINALITY AS a(t, u, d, n) ORDER BY n
         ON CONFLICT (tenant, upload_id) DO UPDATE SET tenant = uploads.tenant
         RETURNING tenant, upload_id, grant_doc, (xmax = 0) AS inserted",
    )
    .bind(&tenants)
    .bind(&ids)
    .bind(&docs)
    .fetch_all(&mut *tx)
    .await
    .context("recording upload answers")?;
    let mut standing: std::collections::BTreeMap<(String, String), Recorded> = std::collections::BTreeMap::new();
    for row in rows {
        let (tenant, id): (String, String) = (row.try_get("tenant")?, row.try_get("upload_id")?);
        let grant = serde_json::from_value(row.try_get("grant_doc")?).context("decoding a recorded upload answer")?;
        standing.insert((tenant, id), Recorded { grant, inserted: row.try_get("inserted")? });
    }
    let mut refused_tenants: Vec<&str> = standing.values().filter(|r| r.inserted && r.grant.status == "rejected").map(|r| r.grant.tenant.as_str()).collect();
    refused_tenants.dedup();
    for tenant in refused_tenants {
        forget_refusals_past_quota(&mut tx, tenant).await?;
    }
    tx.commit().await.context("committing upload answers")?;
    answers
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let key = (a.tenant.as_str(), a.upload_id.as_str());
            let recorded = standing
                .get(&(key.0.to_owned(), key.1.to_owned()))
                .with_context(|| format!("upload {} of tenant {} recorded without its answer", a.upload_id, a.tenant))?;
            let first_copy = first.get(&key) == Some(&i);
            Ok(Recorded { grant: recorded.grant.clone(), inserted: recorded.inserted && first_copy })
        })
        .collect()
}

/// After recording a refusal of `tenant`, if it is over its `max_result_bytes`, delete its refused
/// answers past the newest [`KEPT_REFUSALS_OVER_QUOTA`] (by `created_at`, then upload id: rows
/// of one batch inserted in the same microsecond are in upload-id order, [`record_many`]'s): the
/// newest are read without a lock (`uploads_refused`, migration 0027) for the cutoff; only older answers are locked, and those
/// another recording is deleting are skipped, not waited for.
async fn forget_refusals_past_quota(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, tenant: &str) -> Result<()> {
    let forgotten = sqlx::query(
        "DELETE FROM uploads u USING (
             SELECT r.tenant, r.upload_id FROM uploads r
              WHERE sandcell_over_result_bytes($1)
                AND r.tenant = $1 AND r.grant_doc->>'status' = 'rejected'
                AND (r.created_at, r.upload_id) < (SELECT k.created_at, k.upload_id FROM uploads k
                                     WHERE k.tenant = $1 AND k.grant_doc->>'status' = 'rejected'
                                     ORDER BY k.created_at DESC, k.upload_id DESC OFFSET $2 - 1 LIMIT 1)
              FOR UPDATE SKIP LOCKED) old
          WHERE u.tenant = old.tenant AND u.upload_id = old.upload_id",
    )
    .bind(tenant)
    .bind(KEPT_REFUSALS_OVER_QUOTA)
    .execute(&mut **tx)
    .await
    .context("deleting the old upload refusals of a tenant over its result bytes quota")?
    .rows_affected();
    if forgotten > 0 {
        tracing::debug!(tenant, forgotten, "deleted old upload refusals of a tenant over its result bytes quota");
    }
    Ok(())
}

/// A `ready` grant to record: the answer, the bytes it lets its tenant put in the store, and
/// until when what is put through it is kept.
#[derive(Debug, Clone)]
pub struct GrantAsk {
    /// The answer, with its URLs.
    pub grant: UploadGrant,
    /// The bytes its files may hold together.
    pub bytes: u64,
    /// When its objects are removed (`objects_expire_at`).
    pub objects_expire_at: DateTime<Utc>,
}

/// What [`grant_many`] came to for one grant.
#[derive(Debug, Clone)]
pub enum Granted {
    /// The answer that stands for its upload id: this grant, or one recorded before it.
    Answered(Recorded),
    /// Over a quota: the refusal to record ([`record`]), not written yet.
    Refused(UploadGrant),
    /// Not waiting for locks, its tenant's row was held by another transaction: nothing written.
    Busy,
}

/// How long a batch that does not wait for tenants' rows waits for any other row another
/// transaction holds (a count's shard, a conflicting insert): past it the batch fails, and its
/// grants are recorded each on its own. A batch serves every tenant and holds the rows of the
/// tenants it has taken: it must not wait long for anything.
pub const BATCH_LOCK_TIMEOUT_MS: u32 = 200;

/// Make `tx` wait at most [`BATCH_LOCK_TIMEOUT_MS`] for any lock (`SET LOCAL lock_timeout`).
async fn bound_lock_waits(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>) -> Result<()> {
    sqlx::query(sqlx::AssertSqlSafe(format!("SET LOCAL lock_timeout = '{BATCH_LOCK_TIMEOUT_MS}ms'")))
        .execute(&mut **tx)
        .await
        .context("bounding a batch's lock waits")?;
    Ok(())
}

/// Record a `ready` grant that lets its tenant put `bytes` in the store, kept until
/// `objects_expire_at`, waiting for its tenant's row: [`grant_many`] of one, its refusal
/// recorded ([`record`]).
pub async fn grant(pool: &PgPool, grant: &UploadGrant, bytes: u64, objects_expire_at: DateTime<Utc>, defaults: &Quotas) -> Result<Recorded> {
    let ask = GrantAsk { grant: grant.clone(), bytes, objects_expire_at };
    match grant_many(pool, std::slice::from_ref(&ask), defaults, true).await?.pop() {
        Some(Granted::Answered(recorded)) => Ok(recorded),
        Some(Granted::Refused(refused)) => record(pool, &refused).await,
        Some(Granted::Busy) | None => anyhow::bail!("upload {} of tenant {} was not granted", grant.upload_id, grant.tenant),
    }
}

/// Judge `asks`: each is recorded if its tenant's stored-bytes quota has room for its bytes
/// (under the tenant's row lock, so grants and job commits at the same moment cannot together
/// overshoot it) and its tenant keeps less than its `max_result_bytes`; otherwise it is refused,
/// `quota_exceeded` with the figures, and the refusal is the caller's to record (the intake
/// hands it to a writer of refusals, `scheduler::uploads::UploadRefusals`, so that one tenant's
/// refusals never fill the batches every tenant's grants wait for). As [`record`], a first answer stands. A tenant with no row (named by a trusted
/// publisher) is registered with `defaults`, as by its first job. Answers in the order of `asks`.
///
/// The grants are one statement and one commit, `sandcell_grant_uploads` (migration 0031): the
/// tenant's lock, the standing answer, both quotas and the row for each, taken sorted by tenant
/// and upload id. With `wait_for_locks` false, a grant whose tenant's row another transaction
/// holds is [`Granted::Busy`], and the statement waits at most [`BATCH_LOCK_TIMEOUT_MS`] for any
/// other row.
pub async fn grant_many(pool: &PgPool, asks: &[GrantAsk], defaults: &Quotas, wait_for_locks: bool) -> Result<Vec<Granted>> {
    let mut order: Vec<usize> = (0..asks.len()).collect();
    order.sort_by(|&a, &b| (&asks[a].grant.tenant, &asks[a].grant.upload_id).cmp(&(&asks[b].grant.tenant, &asks[b].grant.upload_id)));
    let mut answers: Vec<Option<Granted>> = vec![None; asks.len()];
    // A tenant the first look found no row of is registered, and its grants asked again.
    for round in 0..2 {
        let mut unknown = Vec::new();
        for (i, outcome) in order.iter().copied().zip(grant_in_one_statement(pool, asks, &order, wait_for_locks).await?) {
            let ask = &asks[i];
            let refusal = match outcome.outcome.as_str() {
                "granted" | "standing" => {
                    let doc = outcome.answer.context("an upload grant recorded without its answer")?;
                    let grant = serde_json::from_value(doc).context("decoding a recorded upload grant")?;
                    answers[i] = Some(Granted::Answered(Recorded { grant, inserted: outcome.inserted }));
                    continue;
                }
                "busy" if !wait_for_locks => {
                    answers[i] = Some(Granted::Busy);
                    continue;
                }
                "unknown_tenant" if round == 0 => {
                    unknown.push(i);
                    continue;
                }
                "over_stored_bytes" => format!(
                    "tenant stores or may upload {} bytes, the upload asks for {} more; its quota is {} (wait for artifacts and uploads to expire)",
                    outcome.used, ask.bytes, outcome.quota
                ),
                "over_result_bytes" => format!(
                    "tenant keeps {} bytes of job results and upload answers in the database; its quota is {} (they are deleted SANDCELL_RESULT_RETENTION_S after they end)",
                    outcome.used, outcome.quota
                ),
                other => anyhow::bail!("granting upload {} of tenant {}: unexpected outcome {other:?}", ask.grant.upload_id, ask.grant.tenant),
            };
            let refused = UploadGrant::rejected(&ask.grant.tenant, &ask.grant.upload_id, Reason::new(ErrorCode::QuotaExceeded, refusal));
            answers[i] = Some(Granted::Refused(refused));
        }
        if unknown.is_empty() {
            break;
        }
        let mut tx = pool.begin().await.context("beginning a tenant's registration")?;
        for &i in &unknown {
            crate::tenants::ensure(&mut tx, &asks[i].grant.tenant, defaults).await?;
        }
        tx.commit().await.context("registering the tenants of upload grants")?;
        order = unknown;
    }
    answers.into_iter().map(|a| a.context("an upload grant left without an answer")).collect()
}

/// What `sandcell_grant_uploads` answered for one grant.
struct Outcome {
    outcome: String,
    answer: Option<serde_json::Value>,
    inserted: bool,
    used: i64,
    quota: i64,
}

/// `asks` taken in `order`, in one statement: one [`Outcome`] each, in that order.
async fn grant_in_one_statement(pool: &PgPool, asks: &[GrantAsk], order: &[usize], wait_for_locks: bool) -> Result<Vec<Outcome>> {
    let mut docs = Vec::with_capacity(order.len());
    for &i in order {
        docs.push(serde_json::to_value(&asks[i].grant).context("encoding an upload grant")?);
    }
    let statement = sqlx::query_as::<_, (i32, String, Option<serde_json::Value>, bool, i64, i64)>(
        "SELECT ord, outcome, answer, inserted, used, quota FROM sandcell_grant_uploads($1, $2, $3, $4, $5, $6) ORDER BY ord",
    )
    .bind(order.iter().map(|&i| asks[i].grant.tenant.as_str()).collect::<Vec<_>>())
    .bind(order.iter().map(|&i| asks[i].grant.upload_id.as_str()).collect::<Vec<_>>())
    .bind(docs)
    .bind(order.iter().map(|&i| i64::try_from(asks[i].bytes).unwrap_or(i64::MAX)).collect::<Vec<_>>())
    .bind(order.iter().map(|&i| asks[i].objects_expire_at).collect::<Vec<_>>())
    .bind(wait_for_locks);
    let rows = if wait_for_locks {
        statement.fetch_all(pool).await.context("recording upload grants")?
    } else {
        let mut tx = pool.begin().await.context("beginning a batch of upload grants")?;
        bound_lock_waits(&mut tx).await?;
        let rows = statement.fetch_all(&mut *tx).await.context("recording upload grants")?;
        tx.commit().await.context("committing a batch of upload grants")?;
        rows
    };
    if rows.len() != order.len() {
        anyhow::bail!("{} answers recorded for {} upload grants", rows.len(), order.len());
    }
    Ok(rows.into_iter().map(|(_, outcome, answer, inserted, used, quota)| Outcome { outcome, answer, inserted, used, quota }).collect())
}

/// A grant whose objects are due for removal.
#[derive(Debug, Clone)]
pub struct ExpiredUpload {
    /// Its tenant.
    pub tenant: String,
    /// Its id.
    pub upload_id: String,
    /// The keys it let the tenant put.
    pub keys: Vec<String>,
}

/// Up to `limit` grants whose objects' time is over and which are not removed yet, oldest first.
/// The keys are read from the document in SQL: a document this version cannot decode (an older
/// or newer one) is still swept.
pub async fn expired(pool: &PgPool, limit: i64) -> Result<Vec<ExpiredUpload>> {
    let rows = sqlx::query(
        "SELECT tenant, upload_id,
                ARRAY(SELECT f->>'s3_key' FROM jsonb_array_elements(CASE WHEN jsonb_typeof(grant_doc->'files') = 'array'
                                                                         THEN grant_doc->'files' ELSE '[]' END) f
                      WHERE f->>'s3_key' IS NOT NULL) AS keys
         FROM uploads
         WHERE objects_expire_at IS NOT NULL AND objects_removed_at IS NULL AND objects_expire_at <= now()
         ORDER BY objects_expire_at LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("scanning expired uploads")?;
    rows.into_iter().map(|r| Ok(ExpiredUpload { tenant: r.try_get("tenant")?, upload_id: r.try_get("upload_id")?, keys: r.try_get("keys")? })).collect()
}

/// Try a grant whose objects could not all be deleted again in `after`, behind the others: one
/// the store keeps refusing must not hold up every later grant's removal. Its bytes still count.
pub async fn postpone(pool: &PgPool, tenant: &str, upload_id: &str, after: std::time::Duration) -> Result<()> {
    sqlx::query("UPDATE uploads SET objects_expire_at = now() + $3 WHERE tenant = $1 AND upload_id = $2 AND objects_removed_at IS NULL")
        .bind(tenant)
        .bind(upload_id)
        .bind(after)
        .execute(pool)
        .await
        .context("postponing an upload's removal")?;
    Ok(())
}

/// Mark a grant's objects removed: its bytes no longer count against its tenant's quota.
pub async fn mark_removed(pool: &PgPool, tenant: &str, upload_id: &str) -> Result<bool> {
    let n = sqlx::query("UPDATE uploads SET objects_removed_at = now() WHERE tenant = $1 AND upload_id = $2 AND objects_removed_at IS NULL")
        .bind(tenant)
        .bind(upload_id)
        .execute(pool)
        .await
        .context("marking an upload's objects removed")?
        .rows_affected();
    Ok(n == 1)
}
