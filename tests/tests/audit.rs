//! Dependencies. The offline dependency audit (`scripts/audit.sh`, run by the suite) fails on
//! a known advisory and names the crate and the advisory; checked with a copy of the RustSec
//! snapshot that gains one advisory against a crate of our lockfile. And the feature split:
//! only the Lambda functions build the Lambda runtime and the Step Functions SDK.

use std::path::{Path, PathBuf};
use std::process::Command;

use leasehold_tests::{repo_root, TempDir};

fn snapshot() -> PathBuf {
    std::env::var_os("LEASEHOLD_ADVISORY_DB")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("..").join("shared").join("advisory-db"))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

fn audit(db: &Path) -> (i32, String) {
    let out = Command::new(repo_root().join("scripts/audit.sh"))
        .env("LEASEHOLD_ADVISORY_DB", db)
        .output()
        .expect("run scripts/audit.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn a_known_advisory_fails_the_audit_naming_crate_and_advisory() {
    let db = snapshot();
    assert!(db.join("crates").is_dir(), "no RustSec snapshot at {}", db.display());
    let (code, text) = audit(&db);
    assert_eq!(code, 0, "today's lockfile has no advisory in the snapshot:\n{text}");

    let tmp = TempDir::new("advisory-db");
    copy_dir(&db, tmp.path());
    let dir = tmp.path().join("crates").join("itoa");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("RUSTSEC-2099-0001.md"),
        "```toml\n[advisory]\nid = \"RUSTSEC-2099-0001\"\npackage = \"itoa\"\ndate = \"2099-01-01\"\n\
         url = \"https://example.invalid/RUSTSEC-2099-0001\"\ncategories = [\"memory-corruption\"]\n\n\
         [versions]\npatched = [\">= 99.0.0\"]\n```\n\n# A test advisory\n\nEvery version of itoa is affected.\n",
    )
    .unwrap();
    let (code, text) = audit(tmp.path());
    assert_ne!(code, 0, "an advisory against a locked crate must fail the audit:\n{text}");
    assert!(text.contains("RUSTSEC-2099-0001"), "the advisory is named:\n{text}");
    assert!(text.contains("itoa"), "the crate is named:\n{text}");
}

/// The normal dependencies of a workspace package, one crate name a line.
fn dependencies(package: &str) -> Vec<String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "-p", package, "-e", "normal", "--prefix", "none", "--locked", "--offline"])
        .current_dir(repo_root())
        .output()
        .expect("run cargo tree");
    assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect()
}

/// The CLI builds without the Lambda runtime and the Step Functions SDK (the workspace's
/// leasehold dependency has default features off; the functions enable `lambda`).
#[test]
fn only_the_functions_build_the_lambda_runtime_and_the_step_functions_sdk() {
    let lambda_only = ["lambda_runtime", "aws-sdk-sfn"];
    let cli = dependencies("leasehold-cli");
    assert!(cli.iter().any(|c| c == "aws-sdk-dynamodb"), "cargo tree lists the CLI's dependencies: {cli:?}");
    for name in lambda_only {
        assert!(!cli.iter().any(|c| c == name), "the CLI builds {name}");
    }
    let acquire = dependencies("acquire");
    for name in lambda_only {
        assert!(acquire.iter().any(|c| c == name), "the acquire function builds {name}: {acquire:?}");
    }
}
