//! Sessions that move between workers: what a draining worker saves of a session, and what the
//! worker taking a session over puts back.
//!
//! - **Files** come from the store, always: every input file the session's jobs brought and
//!   every file they wrote that was stored as an artifact, the latest version of each path
//!   ([`restore_workspace`]). This is all there is after a worker died.
//! - **Variables** come along only after a drain: the draining worker runs a cell of its own in
//!   the session's kernel that pickles each variable with dill (functions and classes defined in
//!   cells by value, modules by reference), keeps those that pickle and names the others
//!   ([`snapshot`]); the object goes to the store under `<tenant>/_sessions/<session>/`, which
//!   no tenant can name as an input. The worker taking the session over writes it into the new
//!   sandbox with the files and loads it in a cell of its own before the session's next job
//!   ([`restore`]). Both cells run as the sandbox user in the session's own kernel, publish no
//!   live events and are no job: they count as one execution in the new kernel's history.

use anyhow::{Context, Result};
use sandcell_core::sessions::{Snapshot, WorkspaceFile};
use sandcell_core::store::Fetched;
use sandcell_protocol::{ErrorCode, ExecutionJob, ExecutionLimits, InputFile, JobSession, JobStatus, Language};

use crate::context::WorkerContext;
use crate::inputs::Resolved;
use crate::kernel::{Kernel, OnTimeout, Stop};

/// Where the cells put the pickled variables, in the workspace.
const SNAPSHOT_PATH: &str = ".sandcell/variables.dill";

/// Pickles each variable on its own (one that fails is named, not fatal), then the whole map.
const SNAPSHOT_CODE: &str = r#"def _sandcell_snapshot():
    import json, os, dill
    ip = get_ipython()
    hidden = set(ip.user_ns_hidden)
    kept, lost = {}, []
    for name, value in list(ip.user_ns.items()):
        if name.startswith('_') or name in hidden:
            continue
        try:
            kept[name] = dill.dumps(value, recurse=True)
        except Exception:
            lost.append(name)
    os.makedirs('.sandcell', exist_ok=True)
    with open('.sandcell/variables.dill', 'wb') as f:
        dill.dump(kept, f)
    print(json.dumps(sorted(lost)))
_sandcell_snapshot()
del _sandcell_snapshot
"#;

/// Loads each variable on its own (one that fails is named), then removes the file.
const RESTORE_CODE: &str = r#"def _sandcell_restore():
    import json, os, dill
    with open('.sandcell/variables.dill', 'rb') as f:
        kept = dill.load(f)
    ns, lost = get_ipython().user_ns, []
    for name, blob in kept.items():
        try:
            ns[name] = dill.loads(blob)
        except Exception:
            lost.append(name)
    os.remove('.sandcell/variables.dill')
    try:
        os.rmdir('.sandcell')
    except OSError:
        pass
    print(json.dumps(sorted(lost)))
_sandcell_restore()
del _sandcell_restore
"#;

/// A cell of the worker's own in the kernel of `tenant`'s session `session_id`.
fn own_cell(tenant: &str, session_id: &str, limits: &ExecutionLimits, code: &str, get_files: Vec<String>) -> ExecutionJob {
    ExecutionJob {
        tenant: tenant.to_string(),
        job_id: format!("sandcell-{}", chrono::Utc::now().timestamp_micros()),
        language: Language::Python,
        code: code.to_string(),
        files: Vec::new(),
        limits: limits.clone(),
        session: Some(JobSession { id: session_id.to_string(), new: false, keep_alive_s: 0, close: false, adopt: None }),
        get_files,
        list_files: false,
        env: Default::default(),
        context: None,
    }
}

/// The names a cell printed as a JSON list on its last line.
fn printed_names(stdout: &str) -> Result<Vec<String>> {
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).with_context(|| format!("the cell printed {last:?}, not a list of names"))
}

/// Save the variables of `tenant`'s session `session_id` to the store (a draining worker,
/// before the session moves); `limits` are the session's.
pub async fn snapshot(ctx: &WorkerContext, kernel: &mut Kernel, tenant: &str, session_id: &str, limits: &ExecutionLimits) -> Result<Snapshot> {
    let cell = own_cell(tenant, session_id, limits, SNAPSHOT_CODE, vec![SNAPSHOT_PATH.to_string()]);
    let mut live = ctx.events.muted(&cell);
    let run = kernel
        .run(&cell, Resolved::unbudgeted(Vec::new()), limits, Stop::at_deadline(OnTimeout::Interrupt(ctx.cfg.kernel.interrupt_grace)), false, &mut live)
        .await;
    let out = run.outcome;
    anyhow::ensure!(
        out.status == JobStatus::Succeeded,
        "the snapshot cell ended {}: {:?} {}",
        out.status,
        out.error.as_ref().map(|e| format!("{}: {}", e.ename, e.evalue)),
        out.reason.as_ref().map(|r| r.message.as_str()).unwrap_or_default()
    );
    let variables_lost = printed_names(&out.stdout.text)?;
    let file = out.files.into_iter().find(|f| f.path == SNAPSHOT_PATH).context("the snapshot was not collected (larger than the session's file limits?)")?;
    let key = format!("{tenant}/_sessions/{session_id}/variables-{}.dill", chrono::Utc::now().timestamp_micros());
    ctx.store.put(&key, file.bytes, "application/octet-stream").await.context("storing the snapshot")?;
    Ok(Snapshot { key, variables_lost })
}

/// What came back into a taken-over session's kernel.
pub struct Restored {
    /// The workspace files were written (they were not when the sandbox refused one).
    pub files: bool,
    /// The snapshot was loaded.
    pub variables: bool,
    /// Variables not carried (`["*"]`: none was).
    pub lost: Vec<String>,
}

/// Write the workspace `files` and load the `snapshot` in a taken-over session's new kernel,
/// before its first job there, in one request (the files first: a variable may need one).
/// `pickle` is the snapshot's object ([`fetch_snapshot`]).
pub async fn restore(
    ctx: &WorkerContext,
    kernel: &mut Kernel,
    job: &ExecutionJob,
    mut files: Vec<InputFile>,
    snapshot: &Snapshot,
    pickle: Vec<u8>,
) -> Restored {
    let everything_lost = || vec!["*".to_string()];
    files.push(InputFile::inline(SNAPSHOT_PATH, &pickle));
    drop(pickle);
    let limits = ctx.cfg.policy.cap(&job.limits);
    let session_id = job.session.as_ref().map(|s| s.id.as_str()).unwrap_or_default();
    let cell = own_cell(&job.tenant, session_id, &limits, RESTORE_CODE, Vec::new());
    let mut live = ctx.events.muted(&cell);
    let run = kernel
        .run(&cell, Resolved::unbudgeted(files), &limits, Stop::at_deadline(OnTimeout::Interrupt(ctx.cfg.kernel.interrupt_grace)), false, &mut live)
        .await;
    let out = run.outcome;
    let files_written = out.reason.as_ref().is_none_or(|r| r.code != ErrorCode::InputFileRejected);
    if out.status != JobStatus::Succeeded {
        tracing::warn!(session_id, status = %out.status, reason = ?out.reason.as_ref().map(|r| &r.message), error = ?out.error.as_ref().map(|e| &e.evalue), "the variables of a moved session could not be loaded");
        return Restored { files: files_written, variables: false, lost: everything_lost() };
    }
    let mut lost = snapshot.variables_lost.clone();
    lost.extend(printed_names(&out.stdout.text).unwrap_or_else(|_| everything_lost()));
    lost.sort();
    lost.dedup();
    Restored { files: true, variables: true, lost }
}

/// Delete a snapshot's object that nothing will read again (it was for one move). A failure
/// is logged: the scheduler's sweeper deletes the snapshot of every session that ended
/// (`sweeper::sweep_snapshots`), and the bucket's lifecycle rule anything left.
pub async fn discard_snapshot(ctx: &WorkerContext, key: &str) {
    if let Err(e) = ctx.store.delete(key).await {
        tracing::warn!(key, error = format!("{e:#}"), "could not delete a session's snapshot");
    }
}

/// Whether `files` and `extra` more bytes fit in a workspace of `workspace_mb`.
pub fn fits(files: &[InputFile], extra: usize, workspace_mb: u64) -> bool {
    let files: u64 = files.iter().map(InputFile::inline_len).sum();
    files.saturating_add(extra as u64) <= workspace_mb.saturating_mul(1 << 20)
}

/// The pickled variables of a snapshot, from the store.
pub async fn fetch_snapshot(ctx: &WorkerContext, snapshot: &Snapshot) -> Result<Vec<u8>> {
    match ctx.store.get_limited(&snapshot.key, ctx.cfg.max_upload_bytes).await.context("reading the snapshot")? {
        Fetched::Found(b) => Ok(b),
        _ => anyhow::bail!("the snapshot {} is gone or too large", snapshot.key),
    }
}

/// A taken-over session's workspace from the store: the files to write (the latest of each
/// path; an older file that would clash with a newer one — a file where a directory now is, or
/// the reverse — is left out), and the paths that could not be put back (their object expired
/// or is gone, or the session's workspace size would be exceeded: what is put back is bounded
/// by `workspace_mb`, so no history of rewritten files can make this worker hold more).
pub async fn restore_workspace(ctx: &WorkerContext, job: &ExecutionJob) -> Result<(Vec<InputFile>, Vec<String>)> {
    let Some(session) = &job.session else { return Ok((Vec::new(), Vec::new())) };
    let mut left = ctx.cfg.policy.cap(&job.limits).workspace_mb.saturating_mul(1 << 20);
    // The newest version of each path, without older files that clash with newer ones.
    let latest = ctx.sessions.workspace_of(&job.tenant, &session.id, left).await?;
    let (mut files, mut missing) = (Vec::new(), Vec::new());
    for f in latest {
        match f {
            WorkspaceFile::Over { path } => missing.push(path),
            WorkspaceFile::Inline { path, content_b64 } => {
                let size = sandcell_protocol::submission::decoded_len(&content_b64);
                if size > left {
                    missing.push(path);
                    continue;
                }
                left -= size;
                files.push(InputFile { path, content_b64: Some(content_b64), s3_key: None });
            }
            WorkspaceFile::Stored { path, available: false, .. } => missing.push(path),
            WorkspaceFile::Stored { path, s3_key, available: true } => match ctx.store.get_base64_limited(&s3_key, ctx.cfg.max_upload_bytes.min(left)).await {
                Ok(Fetched::Found(text)) => {
                    left = left.saturating_sub(sandcell_protocol::submission::decoded_len(&text));
                    files.push(InputFile { path, content_b64: Some(text), s3_key: None });
                }
                Ok(_) => missing.push(path),
                Err(e) => {
                    tracing::warn!(session_id = %session.id, path, error = format!("{e:#}"), "a file of a moved session could not be read from the store");
                    missing.push(path);
                }
            },
        }
    }
    Ok((files, missing))
}

#[cfg(test)]
mod tests {
    use super::printed_names;

    #[test]
    fn the_names_a_cell_prints_are_read_from_its_last_line() {
        assert_eq!(printed_names("noise\n[\"f\", \"gen\"]\n").unwrap(), vec!["f".to_string(), "gen".to_string()]);
        assert!(printed_names("Traceback").is_err());
    }
}
