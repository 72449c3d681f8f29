//! JSON Schemas of every message and result a client sees, generated from the types.
//!
//! `docs/schemas/*.schema.json` are these schemas, committed; the test below fails when a type
//! changes without the files being regenerated (`SANDCELL_BLESS=1 cargo test -p sandcell-protocol`).

use schemars::{schema_for, Schema};

/// `(file name, schema)` for each public document.
pub fn all() -> Vec<(&'static str, Schema)> {
    vec![
        ("submission.schema.json", schema_for!(crate::Submission)),
        ("execution-job.schema.json", schema_for!(crate::ExecutionJob)),
        ("result.schema.json", schema_for!(crate::JobResult)),
        ("session.schema.json", schema_for!(crate::Session)),
        ("event.schema.json", schema_for!(crate::JobEvent)),
        ("job-notification.schema.json", schema_for!(crate::JobNotification)),
        ("upload-request.schema.json", schema_for!(crate::upload::UploadRequest)),
        ("upload-grant.schema.json", schema_for!(crate::upload::UploadGrant)),
        ("cancel-request.schema.json", schema_for!(crate::cancel::CancelRequest)),
    ]
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    #[test]
    fn committed_schemas_match_the_types() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/schemas");
        let bless = std::env::var_os("SANDCELL_BLESS").is_some();
        for (name, schema) in super::all() {
            let text = serde_json::to_string_pretty(&schema).unwrap() + "\n";
            let path = dir.join(name);
            if bless {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &text).unwrap();
            }
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(committed == text, "{name} is stale: run SANDCELL_BLESS=1 cargo test -p sandcell-protocol");
        }
    }
}
