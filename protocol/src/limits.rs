//! Resource limits: the one owner of "how much may a job use".
//!
//! The operator configures a [`LimitPolicy`]: defaults applied when a job asks for nothing, and
//! maximums no job may exceed. A client may request some limits ([`ResourceRequest`]); the
//! policy clamps each request into `[minimum, maximum]` and the result records the limits that
//! were actually applied. Requests are clamped, never refused, so an agent that asks for too much
//! still gets an answer (and can read the effective limits back).
//!
//! [`IntakeLimits`] bound the size of what a client may send at all.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The limits one job runs under. Stored with the job and reported in its result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecutionLimits {
    /// Wall-clock time the code may run, in milliseconds.
    pub timeout_ms: u64,
    /// Memory limit of the sandbox in MiB (swap disabled). The workspace tmpfs counts against it.
    pub memory_mb: u64,
    /// CPU quota, in CPUs (1.0 = one core).
    pub cpus: f64,
    /// Maximum number of processes/threads in the sandbox.
    pub pids: u32,
    /// Size of the writable workspace `/home/user`, in MiB.
    pub workspace_mb: u64,
    /// Bytes of stdout kept; the rest is dropped and `stdout_truncated` set.
    pub stdout_bytes: u64,
    /// Bytes of stderr kept; the rest is dropped and `stderr_truncated` set.
    pub stderr_bytes: u64,
    /// Most output files collected as artifacts.
    pub artifact_files: u32,
    /// Most bytes of output files collected as artifacts (all files together).
    pub artifact_bytes: u64,
    /// Seconds an artifact stays downloadable before the sweeper deletes it.
    pub artifact_ttl_s: u64,
}

/// What a client may ask for. Every field is optional; missing fields take the defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ResourceRequest {
    /// Requested wall-clock timeout in milliseconds.
    pub timeout_ms: Option<u64>,
    /// Requested memory in MiB.
    pub memory_mb: Option<u64>,
    /// Requested CPUs.
    pub cpus: Option<f64>,
    /// Requested artifact time to live in seconds.
    pub artifact_ttl_s: Option<u64>,
}

/// The operator's defaults and maximums.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitPolicy {
    /// Applied when the job does not ask.
    pub default: ExecutionLimits,
    /// No job gets more than this.
    pub max: ExecutionLimits,
}

/// Smallest values a request is raised to, whatever it asks (a 0 ms timeout is meaningless).
const MIN_TIMEOUT_MS: u64 = 100;
const MIN_MEMORY_MB: u64 = 64;
const MIN_CPUS: f64 = 0.05;
const MIN_ARTIFACT_TTL_S: u64 = 1;

impl Default for LimitPolicy {
    fn default() -> Self {
        LimitPolicy {
            default: ExecutionLimits {
                timeout_ms: 30_000,
                memory_mb: 1024,
                cpus: 1.0,
                pids: 128,
                workspace_mb: 256,
                stdout_bytes: 1 << 20,
                stderr_bytes: 1 << 20,
                artifact_files: 50,
                artifact_bytes: 100 << 20,
                artifact_ttl_s: 24 * 3600,
            },
            max: ExecutionLimits {
                timeout_ms: 300_000,
                memory_mb: 4096,
                cpus: 2.0,
                pids: 512,
                workspace_mb: 1024,
                stdout_bytes: 8 << 20,
                stderr_bytes: 8 << 20,
                artifact_files: 200,
                artifact_bytes: 500 << 20,
                // Presigned URLs are valid for at most 7 days with SigV4.
                artifact_ttl_s: 7 * 24 * 3600,
            },
        }
    }
}

impl LimitPolicy {
    /// The limits a job runs under: the request clamped into the policy, defaults elsewhere.
    /// Operator-only limits take the default, itself clamped to the maximum.
    pub fn resolve(&self, req: &ResourceRequest) -> ExecutionLimits {
        let d = &self.default;
        let m = &self.max;
        ExecutionLimits {
            timeout_ms: req.timeout_ms.unwrap_or(d.timeout_ms).clamp(MIN_TIMEOUT_MS, m.timeout_ms.max(MIN_TIMEOUT_MS)),
            memory_mb: req.memory_mb.unwrap_or(d.memory_mb).clamp(MIN_MEMORY_MB, m.memory_mb.max(MIN_MEMORY_MB)),
            cpus: clamp_f64(req.cpus.unwrap_or(d.cpus), MIN_CPUS, m.cpus.max(MIN_CPUS)),
            pids: d.pids.min(m.pids),
            workspace_mb: d.workspace_mb.min(m.workspace_mb),
            stdout_bytes: d.stdout_bytes.min(m.stdout_bytes),
            stderr_bytes: d.stderr_bytes.min(m.stderr_bytes),
            artifact_files: d.artifact_files.min(m.artifact_files),
            artifact_bytes: d.artifact_bytes.min(m.artifact_bytes),
            artifact_ttl_s: req.artifact_ttl_s.unwrap_or(d.artifact_ttl_s).clamp(MIN_ARTIFACT_TTL_S, m.artifact_ttl_s.max(MIN_ARTIFACT_TTL_S)),
        }
    }

    /// Clamp limits that arrived from elsewhere (a queued job) into this policy's maximums.
    /// Workers call this so that a message cannot carry more than the worker's operator allows.
    pub fn cap(&self, l: &ExecutionLimits) -> ExecutionLimits {
        let m = &self.max;
        ExecutionLimits {
            timeout_ms: l.timeout_ms.min(m.timeout_ms),
            memory_mb: l.memory_mb.min(m.memory_mb),
            cpus: clamp_f64(l.cpus, MIN_CPUS, m.cpus.max(MIN_CPUS)),
            pids: l.pids.min(m.pids),
            workspace_mb: l.workspace_mb.min(m.workspace_mb),
            stdout_bytes: l.stdout_bytes.min(m.stdout_bytes),
            stderr_bytes: l.stderr_bytes.min(m.stderr_bytes),
            artifact_files: l.artifact_files.min(m.artifact_files),
            artifact_bytes: l.artifact_bytes.min(m.artifact_bytes),
            artifact_ttl_s: l.artifact_ttl_s.min(m.artifact_ttl_s),
        }
    }
}

fn clamp_f64(v: f64, lo: f64, hi: f64) -> f64 {
    if v.is_nan() {
        lo
    } else {
        v.clamp(lo, hi)
    }
}

/// Bounds on what a client may send.
#[derive(Debug, Clone, PartialEq)]
pub struct IntakeLimits {
    /// Largest submission message, in bytes.
    pub max_message_bytes: usize,
    /// Largest `code`, in bytes.
    pub max_code_bytes: usize,
    /// Most inline input files.
    pub max_input_files: usize,
    /// Largest decoded inline file, in bytes.
    pub max_inline_file_bytes: usize,
    /// Largest sum of decoded inline files, in bytes.
    pub max_inline_total_bytes: usize,
}

impl Default for IntakeLimits {
    fn default() -> Self {
        IntakeLimits {
            max_message_bytes: 16 << 20,
            max_code_bytes: 1 << 20,
            max_input_files: 32,
            max_inline_file_bytes: 8 << 20,
            max_inline_total_bytes: 10 << 20,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_above_the_maximum_are_clamped_to_it() {
        let p = LimitPolicy::default();
        let l = p.resolve(&ResourceRequest { timeout_ms: Some(10_000_000), memory_mb: Some(1 << 30), cpus: Some(64.0), artifact_ttl_s: Some(u64::MAX) });
        assert_eq!(l.timeout_ms, p.max.timeout_ms);
        assert_eq!(l.memory_mb, p.max.memory_mb);
        assert_eq!(l.cpus, p.max.cpus);
        assert_eq!(l.artifact_ttl_s, p.max.artifact_ttl_s);
    }

    #[test]
    fn absurdly_small_requests_are_raised_to_the_floor() {
        let p = LimitPolicy::default();
        let l = p.resolve(&ResourceRequest { timeout_ms: Some(0), memory_mb: Some(1), cpus: Some(f64::NAN), artifact_ttl_s: Some(0) });
        assert_eq!(l.timeout_ms, MIN_TIMEOUT_MS);
        assert_eq!(l.memory_mb, MIN_MEMORY_MB);
        assert_eq!(l.cpus, MIN_CPUS);
        assert_eq!(l.artifact_ttl_s, MIN_ARTIFACT_TTL_S);
    }

    #[test]
    fn no_request_gives_the_defaults() {
        let p = LimitPolicy::default();
        assert_eq!(p.resolve(&ResourceRequest::default()), p.default);
    }

    #[test]
    fn a_worker_caps_limits_carried_by_a_message() {
        let mut small = LimitPolicy::default();
        small.max.memory_mb = 256;
        small.max.timeout_ms = 1000;
        let big = LimitPolicy::default().resolve(&ResourceRequest { memory_mb: Some(4096), ..Default::default() });
        let capped = small.cap(&big);
        assert_eq!(capped.memory_mb, 256);
        assert_eq!(capped.timeout_ms, 1000);
    }
}
