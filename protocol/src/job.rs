//! The execution job: what the scheduler publishes to the workers once a submission is recorded.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::limits::ExecutionLimits;
use crate::session::JobSession;
use crate::submission::{InputFile, Language};

/// One unit of work for a worker. The limits are already resolved by the scheduler; a worker
/// still caps them with its own policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecutionJob {
    /// Tenant that owns the job.
    pub tenant: String,
    /// The client's job id.
    pub job_id: String,
    /// Language of `code`.
    pub language: Language,
    /// Code to run.
    pub code: String,
    /// Files placed in the workspace first.
    #[serde(default)]
    pub files: Vec<InputFile>,
    /// Limits to run under.
    pub limits: ExecutionLimits,
    /// The session the job runs in; absent: a one-off sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<JobSession>,
    /// Workspace files to return as artifacts after the code ran.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub get_files: Vec<String>,
    /// Return a workspace listing after the code ran.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub list_files: bool,
    /// Environment variables of this job's code only (the submission's `env`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub env: std::collections::BTreeMap<String, String>,
    /// The Python namespace of the session the code runs in (the submission's `context`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
}
