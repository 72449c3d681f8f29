//! A job's input files as its sandbox gets them: those given by reference (`s3_key`) fetched
//! from the store, bounded by the job's workspace and, all the worker's jobs together, by its
//! fetch budget ([`FetchBudget`]).

use std::sync::Arc;

use sandcell_core::store::Fetched;
use sandcell_protocol::submission::is_valid_upload_key;
use sandcell_protocol::{ErrorCode, ExecutionJob, InputFile, Reason};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::context::WorkerContext;

/// What the uploads fetched for this worker's jobs may hold of its memory, all together
/// (`SANDCELL_WORKER_FETCH_BYTES`), counted in KiB.
///
/// Why: a job's uploads are fetched before its cell and wait with it for a slot, and a session
/// job waits so in each session the worker holds (up to `SANDCELL_WORKER_MAX_SESSIONS`, 32).
/// Each job's fetch was bounded only by its workspace (256 MiB by default, up to the policy's
/// cap), kept as base64 (4/3 of it): one tenant's sessions, each given a job naming large
/// uploads while the slots were busy, made the worker hold all of them at once, and a pod's
/// memory limit would kill it with every other tenant's sessions (ten jobs of 3 × 30 MB: the
/// worker grew by 1,383 MiB). Now a job reads its objects' sizes, reserves what they take as
/// base64 (at most the whole budget), waits while that does not fit, and holds it until its
/// files are sent to its sandbox (the same ten jobs: 233 MiB).
///
/// A job waiting for a slot may hold the budget, so no job holding a slot waits for it: a new
/// session's opening job, which holds the slot its container started under
/// ([`crate::run::Host::held_slot`]), gives it back first when it has uploads ([`has_uploads`]).
/// A job whose uploads take more than the whole budget waits for all of it, and the jobs behind
/// it wait for it (first come, first served; it is given back as the job's files are sent).
#[derive(Clone)]
pub struct FetchBudget {
    kib: Arc<Semaphore>,
    total: u32,
    /// `sandcell_worker_fetch_budget_waits_total`.
    waits: prometheus::IntCounter,
}

/// Whether `job` names uploads (`s3_key` files): it is fetched within the [`FetchBudget`].
pub fn has_uploads(job: &ExecutionJob) -> bool {
    job.files.iter().any(|f| f.s3_key.is_some())
}

/// Bytes in KiB, rounded up.
fn kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl FetchBudget {
    /// A budget of `bytes` (at least 1 KiB), counting in `waits` the jobs that waited for it.
    pub fn new(bytes: u64, waits: prometheus::IntCounter) -> Self {
        let most = u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX);
        let total = kib(bytes).clamp(1, most);
        FetchBudget { kib: Arc::new(Semaphore::new(total as usize)), total, waits }
    }

    /// Wait until `bytes` fit (at most the whole budget), and take them.
    async fn take(&self, bytes: u64) -> Option<OwnedSemaphorePermit> {
        let want = kib(bytes).min(self.total);
        match self.kib.clone().try_acquire_many_owned(want) {
            Ok(permit) => Some(permit),
            Err(_) => {
                self.waits.inc();
                self.kib.clone().acquire_many_owned(want).await.ok()
            }
        }
    }

    /// KiB of the budget free now.
    #[cfg(test)]
    fn free_kib(&self) -> usize {
        self.kib.available_permits()
    }
}

/// A job's input files, with its part of the fetch budget: given back when dropped, as soon as
/// they are sent to the sandbox (`Kernel::run`), not at the end of the cell.
pub struct Resolved {
    /// The files, every upload replaced by its content.
    pub files: Vec<InputFile>,
    /// The part of the budget they hold.
    pub held: Option<OwnedSemaphorePermit>,
}

impl Resolved {
    /// Files the budget does not count (none fetched for a job, or a moved session's own).
    pub fn unbudgeted(files: Vec<InputFile>) -> Self {
        Resolved { files, held: None }
    }
}

/// What a job's uploads of these `sizes` make this worker hold: each as the base64 it is kept
/// in (encoded as it arrives, `ArtifactStore::get_base64_limited`).
fn held_as_base64(sizes: &[u64]) -> u64 {
    sizes.iter().fold(0u64, |sum, size| sum.saturating_add(sandcell_protocol::submission::encoded_len(*size)))
}

/// What a job's uploads (`s3_key` files) may take of a `workspace` of that many bytes: what its
/// inline files and the `restored` files its own do not replace (one file per path) leave of
/// it. One bound for all a job writes, so a moved session's first job holds at most one
/// workspace, not one restored and one fetched.
fn workspace_left(workspace: u64, own: &[InputFile], restored: &[InputFile]) -> u64 {
    let inline: u64 = own.iter().map(InputFile::inline_len).sum();
    let kept: u64 = restored.iter().filter(|r| !own.iter().any(|f| f.path == r.path)).map(InputFile::inline_len).sum();
    workspace.saturating_sub(inline).saturating_sub(kept)
}

/// Replace every `s3_key` input file by its content. A missing or oversize object is the
/// client's error (`upload_failed`); a store failure is ours (`storage_failed`).
///
/// What is fetched is bounded by the job's workspace (`limits.workspace_mb`, capped by this
/// worker's policy) as well as file by file (`SANDCELL_MAX_UPLOAD_FILE_BYTES`): the files could
/// not fit there anyway, and without it one job naming one upload under 32 paths made this
/// worker hold 32 copies of it (in memory, several times over) before any sandbox refused them.
/// `restored`: files already held for the workspace (a moved session's,
/// [`crate::run::Host::restored`]), which take their part of it unless the job's own files
/// replace them. What is fetched is held within the worker's [`FetchBudget`] (the caller holds
/// no slot).
///
/// The objects' sizes are read first (no body), so a job that cannot run is refused before it
/// waits, and the job reserves of the budget what its objects take; each is then fetched no
/// larger than it was found (an upload's presigned PUT is for one length; should an object
/// change between, it is refused).
pub async fn resolve(ctx: &WorkerContext, job: &ExecutionJob, restored: &[InputFile]) -> Result<Resolved, Reason> {
    let workspace = ctx.cfg.policy.cap(&job.limits).workspace_mb.saturating_mul(1 << 20);
    let mut left = workspace_left(workspace, &job.files, restored);
    // Each file's object size, aligned with the files (`None`: an inline file).
    let mut sizes: Vec<Option<u64>> = Vec::with_capacity(job.files.len());
    for f in &job.files {
        let Some(key) = &f.s3_key else {
            sizes.push(None);
            continue;
        };
        // The scheduler checked the key; a worker trusts no message blindly.
        if !is_valid_upload_key(&job.tenant, key) {
            return Err(Reason::new(ErrorCode::InvalidFilePath, format!("input file {:?}: s3_key is not under the tenant's upload prefix", f.path)));
        }
        let size = match ctx.store.size_of(key).await {
            Ok(Some(size)) => size,
            Ok(None) => return Err(missing(&f.path, key)),
            Err(e) => return Err(Reason::new(ErrorCode::StorageFailed, format!("input file {:?}: {e:#}", f.path))),
        };
        if size > ctx.cfg.max_upload_bytes {
            return Err(Reason::new(
                ErrorCode::UploadFailed,
                format!("input file {:?}: object {key:?} is {size} bytes; the limit is {}", f.path, ctx.cfg.max_upload_bytes),
            ));
        }
        if size > left {
            return Err(Reason::new(
                ErrorCode::UploadFailed,
                format!(
                    "input file {:?}: object {key:?} ({size} bytes) does not fit in what is left of the workspace's {workspace} bytes (limits.workspace_mb) after the job's other input files and the session's files put back",
                    f.path
                ),
            ));
        }
        left -= size;
        sizes.push(Some(size));
    }
    let objects: Vec<u64> = sizes.iter().flatten().copied().collect();
    let mut held = if objects.is_empty() { None } else { ctx.fetch_budget.take(held_as_base64(&objects)).await };
    let mut fetched_b64 = 0u64;
    let mut files = Vec::with_capacity(job.files.len());
    for (f, size) in job.files.iter().zip(sizes) {
        let (Some(key), Some(size)) = (&f.s3_key, size) else {
            files.push(f.clone());
            continue;
        };
        match ctx.store.get_base64_limited(key, size).await {
            Ok(Fetched::Found(text)) => {
                fetched_b64 += text.len() as u64;
                files.push(InputFile { path: f.path.clone(), content_b64: Some(text), s3_key: None });
            }
            Ok(Fetched::Missing) => return Err(missing(&f.path, key)),
            Ok(Fetched::TooLarge(now)) => {
                return Err(Reason::new(
                    ErrorCode::UploadFailed,
                    format!("input file {:?}: object {key:?} grew from {size} to {now} bytes while the job's inputs were fetched", f.path),
                ))
            }
            Err(e) => return Err(Reason::new(ErrorCode::StorageFailed, format!("input file {:?}: {e:#}", f.path))),
        }
    }
    // Only what the fetched files hold stays taken (an object may have shrunk since its size
    // was read); the rest goes back.
    if let Some(permit) = held.as_mut() {
        keep_only(permit, fetched_b64);
    }
    Ok(Resolved { files, held })
}

fn missing(path: &str, key: &str) -> Reason {
    Reason::new(ErrorCode::UploadFailed, format!("input file {path:?}: no object {key:?}"))
}

/// Give back what `permit` holds beyond `bytes`.
fn keep_only(permit: &mut OwnedSemaphorePermit, bytes: u64) {
    let extra = permit.num_permits().saturating_sub(kib(bytes) as usize);
    drop(permit.split(extra));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, content: &str) -> InputFile {
        InputFile::inline(path, content.as_bytes())
    }

    fn budget(bytes: u64) -> FetchBudget {
        FetchBudget::new(bytes, prometheus::IntCounter::new("waits", "waits").expect("a counter"))
    }

    #[test]
    fn a_moved_sessions_restored_files_take_their_part_of_the_workspace_its_first_jobs_uploads_are_fetched_in() {
        let restored = vec![file("data.bin", &"r".repeat(600)), file("notes.txt", &"n".repeat(300))];
        let upload = InputFile { path: "big.csv".into(), content_b64: None, s3_key: Some("acme/_uploads/k".into()) };
        assert_eq!(workspace_left(1000, std::slice::from_ref(&upload), &restored), 100, "the restored 900 bytes leave 100 for the upload");
        let own = vec![upload.clone(), file("notes.txt", &"j".repeat(48))];
        assert_eq!(workspace_left(1000, &own, &restored), 352, "a restored file the job's own replaces does not count, the job's does");
        assert_eq!(workspace_left(1000, std::slice::from_ref(&upload), &[]), 1000, "without a move the workspace is the upload's");
        assert_eq!(workspace_left(500, &[upload], &restored), 0, "more restored than the workspace leaves nothing, never wraps");
    }

    #[test]
    fn a_jobs_reservation_is_its_uploads_as_base64() {
        // 100 and 30 bytes: 136 + 40 as base64 (whole groups of 4, padded).
        assert_eq!(held_as_base64(&[100, 30]), 136 + 40);
        assert_eq!(
            held_as_base64(&[100, 30]),
            (InputFile::inline("a", &[0; 100]).content_b64.unwrap().len() + InputFile::inline("b", &[0; 30]).content_b64.unwrap().len()) as u64
        );
        assert_eq!(held_as_base64(&[]), 0);
        assert_eq!(held_as_base64(&[u64::MAX, 1]), u64::MAX, "never wraps");
    }

    #[tokio::test(start_paused = true)]
    async fn jobs_wait_for_the_fetch_budget_and_keep_only_what_they_fetched() {
        let b = budget(100 << 10);
        let mut first = b.take(80 << 10).await.expect("80 KiB of 100");
        let second = tokio::spawn({
            let b = b.clone();
            async move { b.take(50 << 10).await.map(|p| p.num_permits()) }
        });
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert!(!second.is_finished(), "80 + 50 KiB is over the budget: the second job waits");
        assert_eq!(b.waits.get(), 1);
        keep_only(&mut first, 30 << 10);
        assert_eq!(second.await.expect("the second job"), Some(50), "what the first did not fetch went back, and the second took it");
        assert_eq!(b.free_kib(), 70, "the second's permit went back with its task, the first keeps 30 KiB");
        drop(first);
        assert_eq!(b.take(1 << 40).await.map(|p| p.num_permits()), Some(100), "a job asking more than the budget takes all of it");
    }
}
