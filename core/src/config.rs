//! Configuration from environment variables. Every variable has a documented default
//! (see `docs/configuration.md`); a variable that is set but unparsable is an error, never
//! silently ignored.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use sandcell_protocol::{ExecutionLimits, IntakeLimits, LimitPolicy};

/// Read `name`, or `default` when unset or empty.
pub fn var_or(name: &str, default: &str) -> String {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v,
        _ => default.to_string(),
    }
}

/// Read `name`, a setting that an empty value turns off: `default` when unset, `None` when set
/// but empty (unlike [`var_or`], for which empty means the default).
pub fn var_or_off(name: &str, default: &str) -> Option<String> {
    or_off(std::env::var(name).ok(), default)
}

/// [`var_or_off`]'s rule on a variable's value (`None`: unset).
fn or_off(value: Option<String>, default: &str) -> Option<String> {
    match value {
        None => Some(default.to_string()),
        Some(v) if v.is_empty() => None,
        Some(v) => Some(v),
    }
}

/// Read a required variable.
pub fn var_required(name: &str) -> Result<String> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => Ok(v),
        _ => Err(anyhow!("environment variable {name} is required (see docs/configuration.md; the local stack writes it to /var/lib/sandcell/sandcell.env)")),
    }
}

/// Read and parse `name`, or `default` when unset or empty.
pub fn parse_or<T>(name: &str, default: T) -> Result<T>
where
    T: FromStr,
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v.parse::<T>().map_err(|e| anyhow!("{e}")).with_context(|| format!("invalid value {v:?} for {name}")),
        _ => Ok(default),
    }
}

/// Connection settings of the three stateful services.
#[derive(Debug, Clone)]
pub struct Services {
    /// `SANDCELL_AMQP_URL`.
    pub amqp_url: String,
    /// `SANDCELL_DATABASE_URL`.
    pub database_url: String,
    /// S3 settings.
    pub s3: S3Settings,
}

/// Object store settings (`SANDCELL_S3_*`).
#[derive(Debug, Clone)]
pub struct S3Settings {
    /// Endpoint URL, e.g. `http://127.0.0.1:3900`.
    pub endpoint: String,
    /// Region name the store expects (`garage` for Garage).
    pub region: String,
    /// Bucket holding artifacts.
    pub bucket: String,
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
    /// `SANDCELL_S3_ATTEMPT_TIMEOUT_S`, default 120: how long one attempt of a request to the
    /// store may take before it is given up and retried (the SDK tries 3 times). The SDK has no
    /// limit of its own: a store that accepts connections and never answers held every request
    /// for ever (the scheduler's sweeps, a worker's commit).
    pub attempt_timeout: Duration,
    /// `SANDCELL_S3_MAX_KEY_BYTES`, default 1024 (S3's limit; at most that): the longest object
    /// key the store takes. Garage with its LMDB metadata engine takes 479 (a longer key fails
    /// with an internal error), which `deploy/local/up.sh` sets. A job's file whose key would be
    /// longer is skipped (`invalid_path`) rather than failing the job's storing.
    pub max_key_bytes: usize,
}

impl Services {
    /// Read the service settings from the environment.
    pub fn from_env() -> Result<Self> {
        Ok(Services {
            amqp_url: var_required("SANDCELL_AMQP_URL")?,
            database_url: var_required("SANDCELL_DATABASE_URL")?,
            s3: S3Settings {
                endpoint: var_or("SANDCELL_S3_ENDPOINT", "http://127.0.0.1:3900"),
                region: var_or("SANDCELL_S3_REGION", "garage"),
                bucket: var_or("SANDCELL_S3_BUCKET", "sandcell-artifacts"),
                access_key_id: var_required("SANDCELL_S3_ACCESS_KEY_ID")?,
                secret_access_key: var_required("SANDCELL_S3_SECRET_ACCESS_KEY")?,
                attempt_timeout: Duration::from_secs_f64(parse_or("SANDCELL_S3_ATTEMPT_TIMEOUT_S", 120.0f64)?.clamp(0.1, 86_400.0)),
                max_key_bytes: parse_or("SANDCELL_S3_MAX_KEY_BYTES", sandcell_protocol::MAX_OBJECT_KEY_BYTES)?
                    .clamp(64, sandcell_protocol::MAX_OBJECT_KEY_BYTES),
            },
        })
    }
}

/// The operator's limit policy: `SANDCELL_DEFAULT_<LIMIT>` and `SANDCELL_MAX_<LIMIT>` for each
/// limit, e.g. `SANDCELL_DEFAULT_TIMEOUT_MS`, `SANDCELL_MAX_MEMORY_MB`.
pub fn limit_policy_from_env() -> Result<LimitPolicy> {
    let base = LimitPolicy::default();
    Ok(LimitPolicy { default: limits_from_env("DEFAULT", &base.default)?, max: limits_from_env("MAX", &base.max)? })
}

fn limits_from_env(prefix: &str, d: &ExecutionLimits) -> Result<ExecutionLimits> {
    let n = |name: &str| format!("SANDCELL_{prefix}_{name}");
    Ok(ExecutionLimits {
        timeout_ms: parse_or(&n("TIMEOUT_MS"), d.timeout_ms)?,
        memory_mb: parse_or(&n("MEMORY_MB"), d.memory_mb)?,
        cpus: parse_or(&n("CPUS"), d.cpus)?,
        pids: parse_or(&n("PIDS"), d.pids)?,
        workspace_mb: parse_or(&n("WORKSPACE_MB"), d.workspace_mb)?,
        stdout_bytes: parse_or(&n("STDOUT_BYTES"), d.stdout_bytes)?,
        stderr_bytes: parse_or(&n("STDERR_BYTES"), d.stderr_bytes)?,
        artifact_files: parse_or(&n("ARTIFACT_FILES"), d.artifact_files)?,
        artifact_bytes: parse_or(&n("ARTIFACT_BYTES"), d.artifact_bytes)?,
        artifact_ttl_s: parse_or(&n("ARTIFACT_TTL_S"), d.artifact_ttl_s)?,
    })
}

/// Intake bounds: `SANDCELL_MAX_MESSAGE_BYTES`, `SANDCELL_MAX_CODE_BYTES`,
/// `SANDCELL_MAX_INPUT_FILES`, `SANDCELL_MAX_INLINE_FILE_BYTES`, `SANDCELL_MAX_INLINE_TOTAL_BYTES`.
pub fn intake_limits_from_env() -> Result<IntakeLimits> {
    let d = IntakeLimits::default();
    Ok(IntakeLimits {
        max_message_bytes: parse_or("SANDCELL_MAX_MESSAGE_BYTES", d.max_message_bytes)?,
        max_code_bytes: parse_or("SANDCELL_MAX_CODE_BYTES", d.max_code_bytes)?,
        max_input_files: parse_or("SANDCELL_MAX_INPUT_FILES", d.max_input_files)?,
        max_inline_file_bytes: parse_or("SANDCELL_MAX_INLINE_FILE_BYTES", d.max_inline_file_bytes)?,
        max_inline_total_bytes: parse_or("SANDCELL_MAX_INLINE_TOTAL_BYTES", d.max_inline_total_bytes)?,
    })
}

/// Session keep-alive rules: `SANDCELL_SESSION_KEEP_ALIVE_S` (default 300) and
/// `SANDCELL_SESSION_MAX_KEEP_ALIVE_S` (default 3600).
pub fn keep_alive_policy_from_env() -> Result<sandcell_protocol::KeepAlivePolicy> {
    let d = sandcell_protocol::KeepAlivePolicy::default();
    Ok(sandcell_protocol::KeepAlivePolicy {
        default_s: parse_or("SANDCELL_SESSION_KEEP_ALIVE_S", d.default_s)?,
        max_s: parse_or("SANDCELL_SESSION_MAX_KEEP_ALIVE_S", d.max_s)?,
    })
}

#[cfg(test)]
mod tests {
    use super::or_off;

    #[test]
    fn a_setting_set_empty_is_off_and_one_unset_is_its_default() {
        assert_eq!(or_off(None, "/d"), Some("/d".to_string()));
        assert_eq!(or_off(Some(String::new()), "/d"), None);
        assert_eq!(or_off(Some("/x".into()), "/d"), Some("/x".to_string()));
    }
}
