//! Says, when the end-to-end suites are left out, why and how to run them.

fn main() {
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_E2E");
    if std::env::var_os("CARGO_FEATURE_E2E").is_none() {
        println!(
            "cargo:warning=end-to-end suites not built: they need the live stack. Run `bash deploy/local/test.sh`, \
             or `cargo test -p sandcell-tests --features e2e` with the stack up and its env loaded."
        );
    }
}
