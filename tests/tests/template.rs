//! template.yaml: linted by cfn-lint and `sam validate --lint`, transformed by the SAM
//! translator, and checked for the properties the deployment depends on: IAM auth on every
//! HTTP route, least-privilege roles, the table schema the DynamoDB store expects, and state
//! machines whose every failure path releases the lease.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use leasehold::store::dynamo::{attr, KEEPALIVE_INDEX};
use leasehold_tests::{repo_root, statemachines, tools_dir};
use serde_json::{json, Value};

fn venv_bin(name: &str) -> PathBuf {
    let p = tools_dir().join("venv/bin").join(name);
    assert!(p.exists(), "{} is not installed: run scripts/install-test-deps.sh", p.display());
    p
}

fn template_path() -> PathBuf {
    repo_root().join("template.yaml")
}

/// Runs a tool offline with dummy AWS settings; returns (success, combined output).
fn run_tool(program: PathBuf, args: &[&str]) -> (bool, String) {
    let out = Command::new(&program)
        .args(args)
        .current_dir(repo_root())
        .env("AWS_DEFAULT_REGION", "us-east-1")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .env("SAM_CLI_TELEMETRY", "0")
        .env(
            "PATH",
            format!("{}:{}", tools_dir().join("venv/bin").display(), std::env::var("PATH").unwrap_or_default()),
        )
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// The template as JSON through tests/template_json.py (`raw` or `transformed`).
fn template_json(mode: &str) -> Value {
    let script = repo_root().join("tests/template_json.py");
    let path = template_path();
    let (ok, text) = run_tool(venv_bin("python"), &[script.to_str().unwrap(), mode, path.to_str().unwrap()]);
    assert!(ok, "template_json.py {mode} failed:\n{text}");
    let start = text.find('{').expect("JSON output");
    serde_json::from_str(&text[start..]).unwrap_or_else(|e| panic!("template_json.py {mode}: {e}"))
}

fn raw() -> &'static Value {
    static RAW: OnceLock<Value> = OnceLock::new();
    RAW.get_or_init(|| template_json("raw"))
}

fn transformed() -> &'static Value {
    static OUT: OnceLock<Value> = OnceLock::new();
    OUT.get_or_init(|| template_json("transformed"))
}

fn resources_of<'a>(t: &'a Value, ty: &str) -> Vec<(&'a str, &'a Value)> {
    t["Resources"]
        .as_object()
        .expect("Resources")
        .iter()
        .filter(|(_, r)| r["Type"] == ty)
        .map(|(n, r)| (n.as_str(), r))
        .collect()
}

fn as_list(v: &Value) -> Vec<&Value> {
    match v {
        Value::Array(a) => a.iter().collect(),
        Value::Null => vec![],
        other => vec![other],
    }
}

#[test]
fn cfn_lint_is_clean() {
    let (ok, text) = run_tool(venv_bin("cfn-lint"), &[template_path().to_str().unwrap()]);
    assert!(ok, "cfn-lint template.yaml:\n{text}");
}

#[test]
fn sam_validate_lint_is_clean() {
    let (ok, text) =
        run_tool(venv_bin("sam"), &["validate", "--lint", "--template-file", template_path().to_str().unwrap()]);
    assert!(ok && text.contains("is a valid SAM Template"), "sam validate --lint:\n{text}");
}

#[test]
fn sam_transform_output_is_clean_cloudformation() {
    // What CloudFormation receives after the SAM transform, linted as plain CloudFormation.
    let out = transformed();
    assert!(out.get("Transform").is_none(), "the transform ran");
    let dir = leasehold_tests::TempDir::new("transformed");
    let file = dir.path().join("transformed.json");
    std::fs::write(&file, serde_json::to_vec_pretty(out).unwrap()).unwrap();
    let (ok, text) = run_tool(venv_bin("cfn-lint"), &[file.to_str().unwrap()]);
    assert!(ok, "cfn-lint on the transformed template:\n{text}");
    for name in ["AcquireFunction", "HeartbeatFunction", "ReleaseFunction", "HistoryFunction"] {
        assert_eq!(out["Resources"][name]["Type"], "AWS::Lambda::Function", "{name}");
    }
    // SingleFlight, QueuedSingleFlight, ConcurrencyLimited, ScheduledJob, FencedUpdate (deployed
    // only with a target table) and BatchProcessor (only with a batch work function).
    assert_eq!(resources_of(out, "AWS::StepFunctions::StateMachine").len(), 6);
    let batch = &out["Resources"]["BatchProcessorStateMachine"];
    assert_eq!(batch["Condition"], "HasBatchWorkFunction");
    assert!(batch["Properties"]["DefinitionS3Location"].is_object(), "{batch}");
    assert_eq!(resources_of(out, "AWS::ApiGatewayV2::Api").len(), 1);
}

#[test]
fn lease_table_matches_the_store() {
    let t = raw();
    let tables = resources_of(t, "AWS::DynamoDB::Table");
    let names: BTreeSet<&str> = tables.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, BTreeSet::from(["LeaseTable", "HistoryTable"]), "the lease table and the history table");
    let table = &t["Resources"]["LeaseTable"];
    assert_eq!(table["DeletionPolicy"], "Retain");
    assert_eq!(table["UpdateReplacePolicy"], "Retain");
    let p = &table["Properties"];
    assert_eq!(p["BillingMode"], "PAY_PER_REQUEST");
    assert_eq!(p["KeySchema"], json!([{"AttributeName": attr::KEY, "KeyType": "HASH"}]));
    let defs: HashSet<(String, String)> = p["AttributeDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["AttributeName"].as_str().unwrap().to_string(), d["AttributeType"].as_str().unwrap().to_string()))
        .collect();
    let want: HashSet<(String, String)> = [
        (attr::KEY, "S"),
        (attr::KA_SHARD, "N"),
        (attr::KA_UNTIL, "N"),
        (attr::STATE_SHARD, "S"),
        (attr::EXPIRES_AT, "N"),
        (attr::Q_SHARD, "N"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(defs, want);
    let gsis = p["GlobalSecondaryIndexes"].as_array().expect("GSIs");
    assert_eq!(gsis.len(), 3);
    assert_eq!(gsis[0]["IndexName"], KEEPALIVE_INDEX);
    assert_eq!(
        gsis[0]["KeySchema"],
        json!([{"AttributeName": attr::KA_SHARD, "KeyType": "HASH"}, {"AttributeName": attr::KA_UNTIL, "KeyType": "RANGE"}])
    );
    assert_eq!(gsis[0]["Projection"], json!({"ProjectionType": "ALL"}));
    // The work-state index, as `DynamoStore::create_table` makes it.
    assert_eq!(gsis[1]["IndexName"], leasehold::store::dynamo::STATE_INDEX);
    assert_eq!(
        gsis[1]["KeySchema"],
        json!([{"AttributeName": attr::STATE_SHARD, "KeyType": "HASH"}, {"AttributeName": attr::EXPIRES_AT, "KeyType": "RANGE"}])
    );
    // Only what a batch's candidate needs (the attributes the store's candidate Query names)
    // when StateIndexProjection says INCLUDE; ALL by default, as stacks made before the
    // parameter have it (CloudFormation cannot change a projection in place: upgrade.rs).
    assert_eq!(
        gsis[1]["Projection"],
        json!({"Fn::If": [
            "StateIndexIncludes",
            {"ProjectionType": "INCLUDE", "NonKeyAttributes": leasehold::store::dynamo::STATE_INDEX_ATTRIBUTES},
            {"ProjectionType": "ALL"}
        ]})
    );
    assert_eq!(t["Parameters"]["StateIndexProjection"]["Default"], "ALL");
    assert_eq!(
        t["Conditions"]["StateIndexIncludes"],
        json!({"Fn::Equals": [{"Ref": "StateIndexProjection"}, "INCLUDE"]})
    );
    // The queue index, as `DynamoStore::create_table` makes it.
    assert_eq!(gsis[2]["IndexName"], leasehold::store::dynamo::QUEUE_INDEX);
    assert_eq!(gsis[2]["KeySchema"], json!([{"AttributeName": attr::Q_SHARD, "KeyType": "HASH"}]));
    assert_eq!(gsis[2]["Projection"], json!({"ProjectionType": "KEYS_ONLY"}));
    assert_eq!(p["TimeToLiveSpecification"], json!({"AttributeName": attr::TTL, "Enabled": true}));
    assert_eq!(p["PointInTimeRecoverySpecification"]["PointInTimeRecoveryEnabled"], true);
    assert_eq!(p["SSESpecification"]["SSEEnabled"], true);
    assert_eq!(p["DeletionProtectionEnabled"], json!({"Fn::If": ["ProtectTable", true, false]}));
    assert_eq!(t["Conditions"]["ProtectTable"], json!({"Fn::Equals": [{"Ref": "TableDeletionProtection"}, "true"]}));
}

/// The history table is what `leasehold::history::dynamo` writes and reads: `key` + `sk`, TTL.
#[test]
fn history_table_matches_the_history_function() {
    use leasehold::history::dynamo::attr as h;
    let t = raw();
    let p = &t["Resources"]["HistoryTable"]["Properties"];
    assert_eq!(p["BillingMode"], "PAY_PER_REQUEST");
    assert_eq!(
        p["KeySchema"],
        json!([{"AttributeName": h::KEY, "KeyType": "HASH"}, {"AttributeName": h::SK, "KeyType": "RANGE"}])
    );
    assert_eq!(p["TimeToLiveSpecification"], json!({"AttributeName": h::TTL, "Enabled": true}));
    let f = &t["Resources"]["HistoryFunction"]["Properties"];
    assert_eq!(f["Environment"]["Variables"]["LEASEHOLD_HISTORY_TABLE"], json!({"Ref": "HistoryTable"}));
    let stream = &f["Events"]["LeaseStream"];
    assert_eq!(stream["Type"], "DynamoDB");
    assert_eq!(stream["Properties"]["Stream"], json!({"Fn::GetAtt": ["LeaseTable", "StreamArn"]}));
}

/// The history pipeline loses nothing silently: a batch the function gives up on (retries
/// exhausted, or older than the stream keeps records) goes to an on-failure queue, and alarms
/// watch the function's errors, its lag behind the stream and that queue.
#[test]
fn history_pipeline_fails_over_to_a_queue_and_is_alarmed() {
    let t = raw();
    let stream = &t["Resources"]["HistoryFunction"]["Properties"]["Events"]["LeaseStream"]["Properties"];
    assert_eq!(stream["BisectBatchOnFunctionError"], true);
    assert!(stream["MaximumRetryAttempts"].as_u64().is_some_and(|n| (1..=10).contains(&n)), "{stream}");
    let age = stream["MaximumRecordAgeInSeconds"].as_u64().unwrap();
    assert!(age < 24 * 3600, "given up on before the stream's 24 h retention drops the records: {age}");
    assert_eq!(
        stream["DestinationConfig"],
        json!({"OnFailure": {"Type": "SQS", "Destination": {"Fn::GetAtt": ["HistoryFailures", "Arn"]}}})
    );
    assert_eq!(t["Resources"]["HistoryFailures"]["Type"], "AWS::SQS::Queue");
    let alarms: BTreeMap<&str, &Value> = resources_of(t, "AWS::CloudWatch::Alarm").into_iter().collect();
    let watched = |namespace: &str, metric: &str, dimension: Value| {
        alarms.values().find(|a| {
            let p = &a["Properties"];
            p["Namespace"] == namespace
                && p["MetricName"] == metric
                && as_list(&p["Dimensions"])[0]["Value"] == dimension
        })
    };
    let function = json!({"Ref": "HistoryFunction"});
    for (namespace, metric, dimension) in [
        ("AWS/Lambda", "Errors", function.clone()),
        ("AWS/Lambda", "IteratorAge", function),
        ("AWS/SQS", "ApproximateNumberOfMessagesVisible", json!({"Fn::GetAtt": ["HistoryFailures", "QueueName"]})),
    ] {
        let a = watched(namespace, metric, dimension).unwrap_or_else(|| panic!("no alarm on {namespace} {metric}"));
        let p = &a["Properties"];
        assert_eq!(p["TreatMissingData"], "notBreaching", "{metric}");
        assert_eq!(p["ComparisonOperator"], "GreaterThanOrEqualToThreshold", "{metric}");
        assert_eq!(
            p["AlarmActions"],
            json!({"Fn::If": ["HasAlarmTopic", [{"Ref": "AlarmTopicArn"}], {"Ref": "AWS::NoValue"}]}),
            "{metric}"
        );
    }
}

/// `leasehold table create` makes exactly template.yaml's table: the same key schema, attribute
/// definitions, indexes (keys and projections), TTL, billing and stream
/// (`leasehold::store::table::LEASE_TABLE` is what both the CLI and `table check` use).
#[test]
fn lease_table_is_the_cli_table() {
    use leasehold::store::table::LEASE_TABLE as spec;
    let t = raw();
    // As a stack created with StateIndexProjection=INCLUDE has it (the default, ALL, is what
    // earlier stacks have: `table check` notes it, everything works).
    let resolver = leasehold_tests::cfn::Resolver::new(t, &[("StateIndexProjection", "INCLUDE")]);
    let p = &resolver.resolve(&t["Resources"]["LeaseTable"]["Properties"]);
    assert_eq!(p["BillingMode"], spec.billing);
    assert_eq!(p["KeySchema"], json!([{"AttributeName": spec.key, "KeyType": "HASH"}]));
    let defs: BTreeSet<(String, String)> = p["AttributeDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["AttributeName"].as_str().unwrap().to_string(), d["AttributeType"].as_str().unwrap().to_string()))
        .collect();
    let want: BTreeSet<(String, String)> =
        spec.attributes().iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    assert_eq!(defs, want);
    let gsis: Vec<Value> = spec
        .indexes
        .iter()
        .map(|i| {
            let mut keys = vec![json!({"AttributeName": i.hash.0, "KeyType": "HASH"})];
            keys.extend(i.range.map(|r| json!({"AttributeName": r.0, "KeyType": "RANGE"})));
            let mut projection = json!({"ProjectionType": i.projection});
            if !i.non_key.is_empty() {
                projection["NonKeyAttributes"] = json!(i.non_key);
            }
            json!({
                "IndexName": i.name,
                "KeySchema": keys,
                "Projection": projection,
            })
        })
        .collect();
    assert_eq!(p["GlobalSecondaryIndexes"], json!(gsis));
    assert_eq!(p["TimeToLiveSpecification"], json!({"AttributeName": spec.ttl, "Enabled": true}));
    assert_eq!(p["StreamSpecification"], json!({"StreamViewType": spec.stream}));
    assert_eq!(p["DeletionProtectionEnabled"], json!(spec.deletion_protection));
    assert_eq!(p["PointInTimeRecoverySpecification"]["PointInTimeRecoveryEnabled"], json!(spec.point_in_time_recovery));
}

#[test]
fn functions_are_built_and_configured() {
    let t = raw();
    let globals = &t["Globals"]["Function"];
    assert_eq!(globals["Runtime"], "provided.al2023");
    assert_eq!(globals["Handler"], "bootstrap");
    assert_eq!(globals["Architectures"], json!([{"Ref": "Architecture"}]));
    assert_eq!(t["Parameters"]["Architecture"]["Default"], "arm64");
    assert_eq!(globals["MemorySize"], 128);
    assert_eq!(globals["Environment"]["Variables"]["LEASEHOLD_TABLE"], json!({"Ref": "LeaseTable"}));
    for (name, p) in t["Parameters"].as_object().unwrap() {
        assert!(p["Description"].as_str().is_some_and(|d| d.len() > 10), "parameter {name} has a Description");
    }
    let functions = resources_of(t, "AWS::Serverless::Function");
    let names: BTreeSet<&str> = functions.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, BTreeSet::from(["AcquireFunction", "HeartbeatFunction", "ReleaseFunction", "HistoryFunction"]));
    for (name, f) in &functions {
        let binary = name.trim_end_matches("Function").to_lowercase();
        assert!(
            repo_root().join("functions").join(&binary).join("Cargo.toml").exists(),
            "{binary} is a workspace function"
        );
        assert_eq!(f["Metadata"]["BuildMethod"], "rust-cargolambda", "{name}");
        assert_eq!(f["Metadata"]["BuildProperties"]["Binary"], binary.as_str(), "{name}");
        let p = &f["Properties"];
        assert_eq!(p["CodeUri"], ".", "{name}: CodeUri is the workspace root");
        let role = p["Role"]["Fn::GetAtt"][0].as_str().unwrap_or_else(|| panic!("{name} has its own role"));
        assert_eq!(t["Resources"][role]["Type"], "AWS::IAM::Role");
        let log_group = p["LoggingConfig"]["LogGroup"]["Ref"].as_str().unwrap_or_else(|| panic!("{name} log group"));
        assert_eq!(t["Resources"][log_group]["Properties"]["RetentionInDays"], json!({"Ref": "LogRetentionDays"}));
    }
    // The acquire function's timeout bounds the longest wait it can answer within.
    let acquire_timeout = t["Resources"]["AcquireFunction"]["Properties"]["Timeout"].as_u64().unwrap();
    let max_wait = &t["Parameters"]["MaxWaitMs"];
    assert_eq!(globals["Environment"]["Variables"]["LEASEHOLD_MAX_WAIT_MS"], json!({"Ref": "MaxWaitMs"}));
    let margin = leasehold::api::INVOKE_SAFETY_MARGIN.as_millis() as u64;
    assert!(max_wait["MaxValue"].as_u64().unwrap() + margin <= acquire_timeout * 1000);
    // HTTP callers: the default wait answers before the HTTP API's 30 s integration timeout.
    assert!(max_wait["Default"].as_u64().unwrap() + margin < 30_000);
    assert_eq!(
        t["Resources"]["HeartbeatFunction"]["Properties"]["Environment"]["Variables"]["LEASEHOLD_SWEEP_MAX_ITEMS"],
        json!({"Ref": "SweepMaxItems"})
    );
}

/// The (method, path) -> function routes and each route's authorizer.
#[test]
fn every_http_route_requires_iam() {
    let t = raw();
    let api = &t["Resources"]["Api"];
    assert_eq!(api["Type"], "AWS::Serverless::HttpApi");
    let p = &api["Properties"];
    assert_eq!(p["Auth"]["DefaultAuthorizer"], "AWS_IAM");
    assert_eq!(p["Auth"]["EnableIamAuthorizer"], true);
    assert_eq!(p["DefaultRouteSettings"]["ThrottlingRateLimit"], json!({"Ref": "ApiThrottlingRateLimit"}));
    assert_eq!(p["DefaultRouteSettings"]["ThrottlingBurstLimit"], json!({"Ref": "ApiThrottlingBurstLimit"}));
    let dest = p["AccessLogSettings"]["DestinationArn"]["Fn::GetAtt"][0].as_str().expect("access log group");
    assert_eq!(t["Resources"][dest]["Type"], "AWS::Logs::LogGroup");
    // API Gateway's log delivery writes to /aws/vendedlogs/ without a growing resource policy.
    let name = t["Resources"][dest]["Properties"]["LogGroupName"]["Fn::Sub"].as_str().expect("a named log group");
    assert!(name.starts_with("/aws/vendedlogs/"), "{name}");

    let mut routes = BTreeSet::new();
    for (name, f) in resources_of(t, "AWS::Serverless::Function") {
        for (event, e) in f["Properties"]["Events"].as_object().into_iter().flatten() {
            if e["Type"] != "HttpApi" {
                continue;
            }
            let ep = &e["Properties"];
            assert_eq!(ep["ApiId"], json!({"Ref": "Api"}), "{name}.{event}");
            assert_eq!(ep["Auth"]["Authorizer"], "AWS_IAM", "{name}.{event} is IAM-authorised");
            routes.insert((ep["Method"].as_str().unwrap().to_string(), ep["Path"].as_str().unwrap().to_string(), name));
        }
    }
    let want: BTreeSet<(String, String, &str)> = [
        ("POST", "/leases/acquire/{key+}", "AcquireFunction"),
        ("POST", "/leases/heartbeat/{key+}", "HeartbeatFunction"),
        ("POST", "/leases/release/{key+}", "ReleaseFunction"),
        ("GET", "/leases/{key+}", "HeartbeatFunction"),
        ("POST", "/leases/next/{state}", "AcquireFunction"),
        ("POST", "/leases/put/{key+}", "AcquireFunction"),
        ("POST", "/leases/count/{state}", "HeartbeatFunction"),
    ]
    .into_iter()
    .map(|(m, p, f)| (m.to_string(), p.to_string(), f))
    .collect();
    assert_eq!(routes, want);
    // The routes `leasehold serve` and the functions' router answer are the template's.
    let served: BTreeSet<(String, String)> =
        leasehold::api::ROUTES.iter().map(|(m, p, _)| (m.to_string(), p.to_string())).collect();
    let deployed: BTreeSet<(String, String)> = routes.iter().map(|(m, p, _)| (m.clone(), p.clone())).collect();
    assert_eq!(served, deployed);
    // The key is a greedy `{key+}`, the last segment: keys with `/` match, and an
    // execute-api:Invoke policy can grant a key prefix (.../POST/leases/acquire/tenants/acme/*).
    // The work-state routes end with a `{state}`, which has no `/`.
    for (_, path, _) in &routes {
        let last = if path.starts_with("/leases/next/") || path.starts_with("/leases/count/") {
            "/{state}"
        } else {
            "/{key+}"
        };
        assert!(path.ends_with(last) && path.matches('{').count() == 1, "{path}");
    }

    // After the transform: the OpenAPI body has exactly these routes, each with SigV4 security.
    let body = &transformed()["Resources"]["Api"]["Properties"]["Body"];
    let mut n = 0;
    for (path, methods) in body["paths"].as_object().expect("paths") {
        for (method, op) in methods.as_object().unwrap() {
            n += 1;
            assert_eq!(op["security"], json!([{"AWS_IAM": []}]), "{method} {path}");
        }
    }
    assert_eq!(n, 7);
    assert_eq!(body["components"]["securitySchemes"]["AWS_IAM"]["x-amazon-apigateway-authtype"], "awsSigv4");
}

/// The ARNs a function role may name: the table, its keep-alive index, its own log group,
/// and (DescribeExecution only) the executions of the template's state machines or of those
/// named by the KeepaliveStateMachineArns parameter.
fn allowed_resource(action: &str, resource: &Value, own_log_group: &str) -> bool {
    let table = json!({"Fn::GetAtt": ["LeaseTable", "Arn"]});
    let index = json!({"Fn::Sub": format!("${{LeaseTable.Arn}}/index/{KEEPALIVE_INDEX}")});
    let executions = |machine: &str| json!({"Fn::Sub": format!("arn:${{AWS::Partition}}:states:${{AWS::Region}}:${{AWS::AccountId}}:execution:${{{machine}.Name}}:*")});
    let log_group = json!({"Fn::GetAtt": [own_log_group, "Arn"]});
    match action {
        "dynamodb:Query" => {
            *resource == index
                || *resource == json!({"Fn::Sub": "${LeaseTable.Arn}/index/state"})
                || *resource == json!({"Fn::Sub": "${LeaseTable.Arn}/index/queue"})
        }
        // The history function: the lease table's stream, and its own table's PutItem only.
        "dynamodb:DescribeStream" | "dynamodb:GetRecords" | "dynamodb:GetShardIterator" | "dynamodb:ListStreams" => {
            *resource == json!({"Fn::GetAtt": ["LeaseTable", "StreamArn"]})
        }
        "dynamodb:BatchWriteItem" if own_log_group == "HistoryLogGroup" => {
            *resource == json!({"Fn::GetAtt": ["HistoryTable", "Arn"]})
        }
        // The history stream's on-failure destination.
        "sqs:SendMessage" if own_log_group == "HistoryLogGroup" => {
            *resource == json!({"Fn::GetAtt": ["HistoryFailures", "Arn"]})
        }
        a if a.starts_with("dynamodb:") => *resource == table,
        "states:DescribeExecution" => {
            // A state machine of the template's, by reference or (the BatchProcessor: a
            // reference would make a cycle through HeartbeatFunction) by the name its resource
            // gives it; a conditional one when its condition holds.
            let resource = match resource.get("Fn::If") {
                Some(branches) if branches[2] == json!({"Ref": "AWS::NoValue"}) => &branches[1],
                _ => resource,
            };
            let batch = json!({"Fn::Sub": [
                "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}:execution:batch-processor-${StackUuid}:*",
                {"StackUuid": {"Fn::Select": [2, {"Fn::Split": ["/", {"Ref": "AWS::StackId"}]}]}}
            ]});
            state_machines().iter().any(|m| *resource == executions(m))
                || *resource == batch
                || (resource.get("Fn::Split").is_some()
                    && resource.to_string().contains(r#"{"Ref":"KeepaliveStateMachineArns"}"#))
        }
        // A sweep lists the running executions of each state machine once (ListExecutions acts
        // on the state machine).
        "states:ListExecutions" => {
            MACHINES.iter().chain(&["ConcurrencyLimitedStateMachine"]).any(|m| *resource == json!({"Ref": m}))
                || *resource == json!({"Ref": "KeepaliveStateMachineArns"})
        }
        "logs:CreateLogStream" | "logs:PutLogEvents" => *resource == log_group,
        // The waiter queue's delivery: a service-integration task token belongs to no resource
        // IAM can name (DESIGN.md, "The waiter queue").
        "states:SendTaskSuccess" | "states:SendTaskFailure" => resource.as_str() == Some("*"),
        _ => false,
    }
}

#[test]
fn function_roles_are_least_privilege() {
    let t = raw();
    let expected: [(&str, &[&str]); 4] = [
        (
            "AcquireFunction",
            &[
                "dynamodb:PutItem",
                "dynamodb:UpdateItem",
                "dynamodb:GetItem",
                "dynamodb:DeleteItem",
                "dynamodb:Query",
                "states:SendTaskSuccess",
                "states:SendTaskFailure",
                "logs:CreateLogStream",
                "logs:PutLogEvents",
            ],
        ),
        (
            "HeartbeatFunction",
            &[
                "dynamodb:UpdateItem",
                "dynamodb:GetItem",
                "dynamodb:DeleteItem",
                "dynamodb:Query",
                "states:DescribeExecution",
                "states:ListExecutions",
                "states:SendTaskSuccess",
                "states:SendTaskFailure",
                "logs:CreateLogStream",
                "logs:PutLogEvents",
            ],
        ),
        (
            "ReleaseFunction",
            &[
                "dynamodb:UpdateItem",
                "dynamodb:GetItem",
                "dynamodb:DeleteItem",
                "states:SendTaskSuccess",
                "states:SendTaskFailure",
                "logs:CreateLogStream",
                "logs:PutLogEvents",
            ],
        ),
        (
            "HistoryFunction",
            &[
                "dynamodb:DescribeStream",
                "dynamodb:GetRecords",
                "dynamodb:GetShardIterator",
                "dynamodb:ListStreams",
                "dynamodb:BatchWriteItem",
                "sqs:SendMessage",
                "logs:CreateLogStream",
                "logs:PutLogEvents",
            ],
        ),
    ];
    for (function, want) in expected {
        let p = &t["Resources"][function]["Properties"];
        assert!(p.get("Policies").is_none(), "{function}: permissions come from its role only");
        let role_name = p["Role"]["Fn::GetAtt"][0].as_str().unwrap();
        let own_log_group = p["LoggingConfig"]["LogGroup"]["Ref"].as_str().unwrap();
        let role = &t["Resources"][role_name]["Properties"];
        assert!(role.get("ManagedPolicyArns").is_none(), "{role_name}: no managed policies");
        assert_eq!(
            role["AssumeRolePolicyDocument"]["Statement"],
            json!([{"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}])
        );
        let mut granted = BTreeSet::new();
        for policy in role["Policies"].as_array().expect("inline policies") {
            for st in policy["PolicyDocument"]["Statement"].as_array().unwrap() {
                // A conditional statement: checked as the statement it is when its condition holds.
                let st = match st.get("Fn::If") {
                    Some(branches) => {
                        assert_eq!(branches[2], json!({"Ref": "AWS::NoValue"}), "{role_name}: {st}");
                        &branches[1]
                    }
                    None => st,
                };
                assert_eq!(st["Effect"], "Allow", "{role_name}: {st}");
                assert!(st.get("NotAction").is_none() && st.get("NotResource").is_none(), "{role_name}: {st}");
                let actions = as_list(&st["Action"]);
                let resources = as_list(&st["Resource"]);
                assert!(!resources.is_empty(), "{role_name}: {st}");
                for a in &actions {
                    let a = a.as_str().expect("plain action");
                    assert!(!a.contains('*'), "{role_name}: wildcard action {a}");
                    for r in &resources {
                        assert!(
                            r.as_str() != Some("*") || a == "states:SendTaskSuccess" || a == "states:SendTaskFailure",
                            "{role_name}: {a} on *"
                        );
                        assert!(allowed_resource(a, r, own_log_group), "{role_name}: {a} on {r}");
                    }
                    granted.insert(a.to_string());
                }
            }
        }
        let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
        assert_eq!(granted, want, "{function}: exactly the calls it makes");
    }
}

#[test]
fn keepalive_sweep_is_scheduled() {
    let t = raw();
    let events = &t["Resources"]["HeartbeatFunction"]["Properties"]["Events"];
    let sweep: Vec<&Value> = events.as_object().unwrap().values().filter(|e| e["Type"] == "Schedule").collect();
    assert_eq!(sweep.len(), 1);
    let period = json!({"Ref": "KeepaliveSweepPeriodMinutes"});
    assert_eq!(sweep[0]["Properties"]["Schedule"], json!({"Fn::FindInMap": ["SweepPeriod", period, "Schedule"]}));
    // No Input: the function must receive EventBridge's own Scheduled Event to run the sweep.
    assert!(sweep[0]["Properties"].get("Input").is_none());
    assert_eq!(t["Parameters"]["KeepaliveSweepPeriodMinutes"]["Default"], 1);
    // The functions know the period (keep-alive leases must last KEEPALIVE_SWEEPS of them),
    // and the mapping's schedule, period and keep-alive duration agree for every allowed value.
    assert_eq!(
        t["Globals"]["Function"]["Environment"]["Variables"]["LEASEHOLD_SWEEP_PERIOD_MS"],
        json!({"Fn::FindInMap": ["SweepPeriod", period, "Ms"]})
    );
    let map = t["Mappings"]["SweepPeriod"].as_object().expect("SweepPeriod mapping");
    let allowed: BTreeSet<String> = t["Parameters"]["KeepaliveSweepPeriodMinutes"]["AllowedValues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string().trim_matches('"').to_string())
        .collect();
    assert_eq!(allowed, map.keys().cloned().collect::<BTreeSet<_>>());
    for (minutes, row) in map {
        let m: u64 = minutes.parse().unwrap();
        let schedule = if m == 1 { "rate(1 minute)".to_string() } else { format!("rate({m} minutes)") };
        assert_eq!(row["Schedule"], schedule.as_str());
        assert_eq!(row["Ms"].as_u64(), Some(m * 60_000), "{minutes}");
        let min = leasehold::validate::KEEPALIVE_SWEEPS as u64 * m * 60_000;
        assert_eq!(row["KeepaliveMs"].as_u64(), Some(min), "{minutes}: the workflow's default keep-alive duration");
    }
    // The example workflow asks for that duration when it keeps a lease alive.
    let subs = &t["Resources"]["SingleFlightStateMachine"]["Properties"]["DefinitionSubstitutions"];
    assert_eq!(subs["KeepaliveDurationMs"], json!({"Fn::FindInMap": ["SweepPeriod", period, "KeepaliveMs"]}));
    let ka = &states(definition("SingleFlightStateMachine"))["KeepaliveDefaults"]["Parameters"]["defaults"];
    assert_eq!(ka["duration_ms.$"], "States.StringToJson('${KeepaliveDurationMs}')");
    // Only the heartbeat function takes scheduled events.
    for f in ["AcquireFunction", "ReleaseFunction"] {
        let ev = &t["Resources"][f]["Properties"]["Events"];
        assert!(ev.as_object().unwrap().values().all(|e| e["Type"] == "HttpApi"), "{f}");
    }
}

#[test]
fn outputs_name_every_entry_point() {
    let t = raw();
    let outputs = t["Outputs"].as_object().expect("Outputs");
    let values: Vec<String> = outputs.values().map(|o| o["Value"].to_string()).collect();
    for needle in [
        r#"{"Ref":"LeaseTable"}"#,
        "${Api}.execute-api",
        r#"["AcquireFunction","Arn"]"#,
        r#"["HeartbeatFunction","Arn"]"#,
        r#"["ReleaseFunction","Arn"]"#,
        r#"{"Ref":"HistoryTable"}"#,
        r#"{"Ref":"SingleFlightStateMachine"}"#,
        r#"{"Ref":"ScheduledJobStateMachine"}"#,
        r#"{"Ref":"FencedUpdateStateMachine"}"#,
        r#"{"Ref":"ConcurrencyLimitedStateMachine"}"#,
    ] {
        assert!(values.iter().any(|v| v.contains(needle)), "an output has {needle}: {values:?}");
    }
    for (name, o) in outputs {
        assert!(o["Description"].is_string(), "output {name} has a Description");
    }
}

// ---- state machines ------------------------------------------------------------------------

const MACHINES: [&str; 2] = ["SingleFlightStateMachine", "ScheduledJobStateMachine"];

/// The definition file template.yaml names in `machine`'s DefinitionUri, as written.
fn definition(machine: &str) -> &'static Value {
    static DEFINITIONS: OnceLock<BTreeMap<String, Value>> = OnceLock::new();
    let all = DEFINITIONS.get_or_init(|| {
        state_machines().into_iter().map(|m| (m.to_string(), statemachines::parsed(definition_name(m)))).collect()
    });
    all.get(machine).unwrap_or_else(|| panic!("{machine} is not a state machine of the template"))
}

/// The template's state machine resources.
fn state_machines() -> Vec<&'static str> {
    let resources = raw()["Resources"].as_object().expect("Resources");
    resources.iter().filter(|(_, r)| r["Type"] == "AWS::Serverless::StateMachine").map(|(n, _)| n.as_str()).collect()
}

fn definition_name(machine: &str) -> &'static str {
    let uri = raw()["Resources"][machine]["Properties"]["DefinitionUri"].as_str();
    statemachines::name_of_uri(uri.unwrap_or_else(|| panic!("{machine} has a DefinitionUri")))
}

#[test]
fn state_machine_definitions_live_in_their_files_and_every_reference_is_substituted() {
    let machines = state_machines();
    assert!(machines.len() >= 3, "{machines:?}");
    for machine in machines {
        let props = &raw()["Resources"][machine]["Properties"];
        assert!(props.get("Definition").is_none(), "{machine}: the definition is in statemachines/, not inline");
        let name = definition_name(machine);
        let text = statemachines::text(name);
        assert!(text.len() > 100 && definition(machine)["States"].is_object(), "{machine}: {name}.asl.json");
        let subs: BTreeSet<String> =
            props["DefinitionSubstitutions"].as_object().expect("DefinitionSubstitutions").keys().cloned().collect();
        assert_eq!(statemachines::references(&text), subs, "{machine}: references and substitutions differ");
    }
}

fn states(def: &Value) -> &serde_json::Map<String, Value> {
    def["States"].as_object().expect("States")
}

/// Every state reachable from `from` (itself included), through Next, Default, Choices and Catch.
fn reachable<'a>(def: &'a Value, from: &'a str) -> BTreeSet<&'a str> {
    let all = states(def);
    let mut seen = BTreeSet::new();
    let mut todo = vec![from];
    while let Some(name) = todo.pop() {
        if !seen.insert(name) {
            continue;
        }
        let s = all.get(name).unwrap_or_else(|| panic!("state {name} does not exist"));
        let mut next: Vec<&str> = vec![];
        next.extend(s["Next"].as_str());
        next.extend(s["Default"].as_str());
        for c in s["Choices"].as_array().into_iter().flatten() {
            next.extend(c["Next"].as_str());
        }
        for c in s["Catch"].as_array().into_iter().flatten() {
            next.extend(c["Next"].as_str());
        }
        todo.extend(next);
    }
    seen
}

fn lambda_function(state: &Value) -> String {
    let p = &state["Parameters"];
    p["FunctionName"].as_str().or(p["FunctionName.$"].as_str()).unwrap_or_default().to_string()
}

#[test]
fn state_machines_release_on_every_path() {
    for machine in MACHINES {
        let def = definition(machine);
        let all = states(def);
        let release = "Release";
        assert_eq!(lambda_function(&all[release]), "${ReleaseFunctionArn}", "{machine}");
        assert_eq!(all["Acquire"]["Type"], "Task");
        assert_eq!(lambda_function(&all["Acquire"]), "${AcquireFunctionArn}", "{machine}");
        // The work path after a successful acquire leads to the release.
        assert!(reachable(def, all["Acquire"]["Next"].as_str().unwrap()).contains(release), "{machine}");
        for (name, s) in all {
            if s["Type"] != "Task" {
                continue;
            }
            assert_eq!(s["Resource"], "arn:${Partition}:states:::lambda:invoke", "{machine}.{name}");
            if name == release {
                // The release's own failure still ends the execution in a failure state.
                let catches = s["Catch"].as_array().expect("Release catches");
                assert!(catches.iter().any(|c| c["ErrorEquals"] == json!(["States.ALL"])));
                continue;
            }
            // Every task catches everything, and every catch leads to the release, except
            // LeaseHeld from the acquire (nothing was taken, so nothing to release).
            let catches = s["Catch"].as_array().unwrap_or_else(|| panic!("{machine}.{name} has no Catch"));
            assert!(
                catches.iter().any(|c| c["ErrorEquals"] == json!(["States.ALL"])),
                "{machine}.{name} catches States.ALL"
            );
            for c in catches {
                let target = c["Next"].as_str().unwrap();
                let only_held = c["ErrorEquals"] == json!(["LeaseHeld"]);
                if name == "Acquire" && only_held {
                    continue;
                }
                assert!(
                    c["ResultPath"].as_str().is_some_and(|p| p != "$"),
                    "{machine}.{name}: a catch keeps the state"
                );
                assert!(
                    reachable(def, target).contains(release),
                    "{machine}.{name}: catch {} -> {target} never reaches {release}",
                    c["ErrorEquals"]
                );
            }
            // And the success path of every task reaches the release too.
            let next = s["Next"].as_str().unwrap_or_else(|| panic!("{machine}.{name} ends the execution"));
            assert!(reachable(def, next).contains(release), "{machine}.{name} -> {next}");
        }
        // Failures end in Fail states, reached only after the release (or before the acquire:
        // input refused, nothing taken).
        let fails: Vec<&str> = all.iter().filter(|(_, s)| s["Type"] == "Fail").map(|(n, _)| n.as_str()).collect();
        assert!(!fails.is_empty(), "{machine} has Fail states");
        // ReleaseStale gives back the lease of a run before a redrive (statemachines::rule).
        let mut after_release = reachable(def, release);
        if all.contains_key("ReleaseStale") {
            after_release.extend(reachable(def, "ReleaseStale"));
        }
        let after_acquire = reachable(def, "Acquire");
        for (name, s) in all.iter().filter(|(n, _)| after_acquire.contains(n.as_str())) {
            let mut next: Vec<&str> = vec![];
            next.extend(s["Next"].as_str());
            next.extend(s["Default"].as_str());
            for c in s["Choices"].as_array().into_iter().flatten().chain(s["Catch"].as_array().into_iter().flatten()) {
                next.extend(c["Next"].as_str());
            }
            if next.iter().any(|n| fails.contains(n)) {
                assert!(after_release.contains(name.as_str()), "{machine}.{name} fails without releasing");
            }
        }
        // The whole graph is connected.
        let from_start = reachable(def, def["StartAt"].as_str().unwrap());
        assert_eq!(from_start.len(), all.len(), "{machine}: unreachable states");
    }
}

#[test]
fn state_machines_are_idempotent_and_carry_the_fence() {
    for machine in MACHINES {
        let def = definition(machine);
        let all = states(def);
        let acquire = &all["Acquire"];
        // The lease_id comes from States.UUID() once, before the acquire (retries reuse it).
        let makes_id = all.values().any(|s| s["Type"] == "Pass" && s["Parameters"]["lease_id.$"] == "States.UUID()");
        assert!(makes_id, "{machine}: States.UUID() lease_id");
        assert!(!reachable(def, "Acquire").iter().any(|n| all[*n]["Parameters"]["lease_id.$"] == "States.UUID()"));
        assert_eq!(acquire["Parameters"]["Payload.$"], "$.request", "{machine}");
        assert_eq!(acquire["ResultPath"], "$.lease");
        assert_eq!(acquire["ResultSelector"]["fence.$"], "$.Payload.fence");
        // The release uses the request's lease_id, known even when the acquire's answer was lost.
        assert_eq!(
            all["Release"]["Parameters"]["Payload"],
            json!({"key.$": "$.request.key", "lease_id.$": "$.request.lease_id"})
        );
        // The work gets the fence.
        assert_eq!(all["Work"]["Parameters"]["Payload"]["fence.$"], "$.lease.fence", "{machine}");
        assert_eq!(all["Work"]["Parameters"]["FunctionName.$"], "$.work_function");
        assert_eq!(all["Placeholder"]["Type"], "Wait");
        // Transient errors are retried (the same lease_id makes that safe).
        let retried: Vec<String> = acquire["Retry"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r["ErrorEquals"].as_array().unwrap().iter().map(|e| e.as_str().unwrap().to_string()))
            .collect();
        for e in [
            "StoreUnavailable",
            "Throttled",
            "OutcomeUnknown",
            "Lambda.ServiceException",
            "Lambda.TooManyRequestsException",
        ] {
            assert!(retried.iter().any(|r| r == e), "{machine}: Acquire retries {e}");
        }
        // The requests name the holder after the execution.
        for s in all.values() {
            if s["ResultPath"] == "$.request" {
                assert_eq!(s["Parameters"]["holder.$"], "$$.Execution.Name");
            }
        }
        // Policies: invoke the two functions (and the optional work function).
        let policies = raw()["Resources"][machine]["Properties"]["Policies"].as_array().unwrap();
        let invoked: BTreeSet<String> = policies
            .iter()
            .filter_map(|p| p["LambdaInvokePolicy"]["FunctionName"]["Ref"].as_str().map(str::to_string))
            .collect();
        assert_eq!(invoked, BTreeSet::from(["AcquireFunction".to_string(), "ReleaseFunction".to_string()]));
    }

    let single = states(definition("SingleFlightStateMachine"));
    let held_retry = single["Acquire"]["Retry"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["ErrorEquals"] == json!(["LeaseHeld"]))
        .expect("single flight retries LeaseHeld");
    assert!(held_retry["BackoffRate"].as_f64().unwrap() > 1.0 && held_retry["MaxAttempts"].as_u64().unwrap() >= 3);
    let ka = &single["RequestWithKeepalive"]["Parameters"]["keepalive"];
    assert_eq!(ka["execution_arn.$"], "$$.Execution.Id");

    let scheduled_def = definition("ScheduledJobStateMachine");
    let scheduled = states(scheduled_def);
    assert!(scheduled["Request"]["Parameters"].get("wait_ms.$").is_none(), "the scheduled job never waits");
    let acquire = &scheduled["Acquire"];
    assert!(
        !acquire["Retry"].as_array().unwrap().iter().any(|r| r["ErrorEquals"].to_string().contains("LeaseHeld")),
        "the scheduled job does not retry LeaseHeld"
    );
    let skip = acquire["Catch"].as_array().unwrap().iter().find(|c| c["ErrorEquals"] == json!(["LeaseHeld"])).unwrap();
    let skip_state = &scheduled[skip["Next"].as_str().unwrap()];
    assert_eq!(skip_state["Type"], "Pass");
    assert_eq!(skip_state["Parameters"]["skipped"], true);
    assert_eq!(scheduled[skip_state["Next"].as_str().unwrap()]["Type"], "Succeed");
    let events = &raw()["Resources"]["ScheduledJobStateMachine"]["Properties"]["Events"];
    let schedule = events.as_object().unwrap().values().find(|e| e["Type"] == "Schedule").expect("scheduled");
    assert_eq!(schedule["Properties"]["Schedule"], json!({"Ref": "ScheduledJobSchedule"}));
}

#[test]
fn fenced_update_writes_with_the_fence_condition_and_releases_on_every_path() {
    const M: &str = "FencedUpdateStateMachine";
    let t = raw();
    let res = &t["Resources"][M];
    assert_eq!(res["Condition"], "HasFencedTarget", "deployed only with a target table");
    assert_eq!(
        t["Conditions"]["HasFencedTarget"],
        json!({"Fn::Not": [{"Fn::Equals": [{"Ref": "FencedTargetTableName"}, ""]}]})
    );
    let def = definition(M);
    let all = states(def);
    assert_eq!(lambda_function(&all["Acquire"]), "${AcquireFunctionArn}");
    assert_eq!(lambda_function(&all["Release"]), "${ReleaseFunctionArn}");
    assert_eq!(all["Acquire"]["ResultSelector"]["fence.$"], "$.Payload.fence");
    assert!(all.values().any(|s| s["Type"] == "Pass" && s["Parameters"]["lease_id.$"] == "States.UUID()"));
    assert_eq!(
        all["Release"]["Parameters"]["Payload"],
        json!({"key.$": "$.request.key", "lease_id.$": "$.request.lease_id"})
    );
    // The guarded write: the DynamoDB service integration, no Lambda, the library's condition.
    let w = &all["FencedWrite"];
    assert_eq!(w["Resource"], "arn:${Partition}:states:::dynamodb:updateItem");
    let p = &w["Parameters"];
    assert_eq!(p["TableName"], "${FencedTargetTableName}");
    // The fence condition; resumed by a redrive in a later run than its lease's, one no item
    // meets (statemachines::rule).
    let condition = p["ConditionExpression.$"].as_str().expect("ConditionExpression.$");
    let first = format!("States.Array('{}', ", leasehold::fenced::FENCE_CONDITION);
    assert!(condition.contains(&first) && condition.contains(statemachines::rule::REDRIVE_COUNT), "{condition}");
    assert!(p["UpdateExpression"].as_str().unwrap().starts_with("SET #lh_fence = :lh_fence"), "records the fence");
    assert_eq!(p["ExpressionAttributeNames"]["#lh_fence"], leasehold::fenced::DEFAULT_ATTRIBUTE);
    assert_eq!(p["ExpressionAttributeValues"][":lh_fence"]["N.$"], "States.JsonToString($.lease.fence)");
    assert_eq!(w["ResultPath"], Value::Null);
    let catches = w["Catch"].as_array().unwrap();
    let refused = catches.iter().find(|c| c["ErrorEquals"] == json!(["DynamoDB.ConditionalCheckFailedException"]));
    let refused = refused.expect("a refused write is caught");
    assert_eq!(refused["ResultPath"], "$.fenced");
    assert!(reachable(def, refused["Next"].as_str().unwrap()).contains("Release"));
    assert!(catches.iter().any(|c| c["ErrorEquals"] == json!(["States.ALL"])
        && reachable(def, c["Next"].as_str().unwrap()).contains("Release")));
    assert!(reachable(def, w["Next"].as_str().unwrap()).contains("Release"));
    for (name, s) in all {
        if s["Type"] == "Task" && name != "Release" {
            let catches = s["Catch"].as_array().unwrap_or_else(|| panic!("{name} catches"));
            for c in catches {
                assert!(
                    reachable(def, c["Next"].as_str().unwrap()).contains("Release"),
                    "{name}: catch skips the release"
                );
            }
        }
    }
    // A refused write fails the execution as Fenced, after the release.
    assert!(reachable(def, "Release").contains("Fenced"));
    assert_eq!(all["Fenced"]["Type"], "Fail");
    assert_eq!(all["Fenced"]["Error"], "Fenced");
    assert_eq!(reachable(def, def["StartAt"].as_str().unwrap()).len(), all.len(), "unreachable states");
    // Policies: the two functions, and UpdateItem on the target table only.
    let policies = res["Properties"]["Policies"].as_array().unwrap();
    let statements: Vec<&Value> = policies.iter().filter_map(|p| p["Statement"].as_array()).flatten().collect();
    assert_eq!(statements.len(), 1, "{statements:?}");
    assert_eq!(statements[0]["Action"], "dynamodb:UpdateItem");
    let resource = statements[0]["Resource"].to_string();
    assert!(resource.contains("table/${FencedTargetTableName}") && !resource.contains('*'), "{resource}");
    assert_eq!(
        res["Properties"]["DefinitionSubstitutions"]["FencedTargetTableName"],
        json!({"Ref": "FencedTargetTableName"})
    );
}

/// ConcurrencyLimited (DESIGN.md, "Semaphores"): each Map iteration takes a slot of the input's
/// semaphore with a lease_id made once before its first attempt, polls a full semaphore with the
/// same lease_id (bounded), releases on every path after a slot may have been taken, and its
/// work step cannot outlast the default slot duration.
#[test]
fn concurrency_limited_takes_a_slot_per_item_and_releases_on_every_path() {
    const M: &str = "ConcurrencyLimitedStateMachine";
    let def = definition(M);
    let map = &states(def)["ForEachItem"];
    assert_eq!((map["Type"].as_str(), map["ItemsPath"].as_str()), (Some("Map"), Some("$.current.chunk")));
    assert!(!map["ItemSelector"].to_string().contains("chunks"), "no iteration carries the whole list");
    let it = &map["ItemProcessor"];
    let all = states(it);
    let acquire = &all["Acquire"];
    assert_eq!(lambda_function(acquire), "${AcquireFunctionArn}");
    assert_eq!(acquire["Parameters"]["Payload.$"], "$.request");
    let request = &all["Request"]["Parameters"];
    assert_eq!(request["slots.$"], "$.config.slots");
    assert_eq!(request["lease_id.$"], "$.slot.lease_id");
    assert_eq!(all["Init"]["Parameters"]["slot"]["lease_id.$"], "States.UUID()");
    assert!(!reachable(it, "Acquire").contains("Init"), "the lease_id is made once per iteration");
    assert_eq!(all["CountPoll"]["Parameters"]["lease_id.$"], "$.slot.lease_id", "polls keep the lease_id");
    // Full: wait and ask again, up to max_polls times.
    let catches = acquire["Catch"].as_array().unwrap();
    let held = catches.iter().find(|c| c["ErrorEquals"] == json!(["LeaseHeld"])).expect("LeaseHeld caught");
    let full = reachable(it, held["Next"].as_str().unwrap());
    for s in ["WaitForSlot", "Acquire", "NoSlot"] {
        assert!(full.contains(s), "a full semaphore leads to {s}");
    }
    assert_eq!(all["WaitForSlot"]["Type"], "Wait");
    assert!(!reachable(it, "NoSlot").contains("Release"), "LeaseHeld: nothing to release");
    // Every other path after the acquire reaches the release.
    let release = &all["Release"];
    assert_eq!(lambda_function(release), "${ReleaseFunctionArn}");
    assert_eq!(release["Parameters"]["Payload"], json!({"key.$": "$.request.key", "lease_id.$": "$.request.lease_id"}));
    for (name, s) in all {
        if s["Type"] != "Task" || name == "Release" {
            continue;
        }
        let catches = s["Catch"].as_array().unwrap_or_else(|| panic!("{name} has no Catch"));
        assert!(catches.iter().any(|c| c["ErrorEquals"] == json!(["States.ALL"])), "{name} catches States.ALL");
        for c in catches {
            if name == "Acquire" && c["ErrorEquals"] == json!(["LeaseHeld"]) {
                continue;
            }
            assert!(reachable(it, c["Next"].as_str().unwrap()).contains("Release"), "{name}: {c}");
        }
        assert!(reachable(it, s["Next"].as_str().unwrap()).contains("Release"), "{name}");
    }
    assert!(reachable(it, release["Next"].as_str().unwrap()).contains("ItemDone"));
    assert_eq!(reachable(it, it["StartAt"].as_str().unwrap()).len(), all.len(), "unreachable states");
    // The work step ends before the slot's least duration (statemachines::rule checks every
    // path); the default duration is one the definition accepts.
    let rule = statemachines::rule::check(M, def);
    assert!(rule.violations.is_empty(), "{:#?}", rule.violations);
    assert_eq!(rule.timed_work, BTreeSet::from(["ForEachItem/Work".to_string()]));
    let least = states(def)["Validate"]["Choices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["Variable"] == "$.args.duration_ms" && c["NumericLessThan"].is_u64())
        .map(|c| c["NumericLessThan"].as_u64().unwrap())
        .expect("the least duration is checked");
    let duration = states(def)["Defaults"]["Parameters"]["defaults"]["duration_ms"].as_u64().unwrap();
    assert!(duration >= least, "{duration} < {least}");
    let work = &all["Work"];
    assert_eq!(work["ResultPath"], Value::Null);
    assert!(work.as_object().unwrap().contains_key("ResultPath"));
    // Policies: invoke the two functions (and the optional work function).
    let policies = raw()["Resources"][M]["Properties"]["Policies"].as_array().unwrap();
    let invoked: BTreeSet<String> = policies
        .iter()
        .filter_map(|p| p["LambdaInvokePolicy"]["FunctionName"]["Ref"].as_str().map(str::to_string))
        .collect();
    assert_eq!(invoked, BTreeSet::from(["AcquireFunction".to_string(), "ReleaseFunction".to_string()]));
}

/// ConcurrencyLimited binds its slots to the execution (keep-alive) up to the number of slots
/// whose holders' entries still have room for the longest execution ARN this template's state
/// machine can have, derived from the item's limits; the sweep may describe and list its
/// executions.
#[test]
fn concurrency_limited_binds_its_slots_to_the_execution_where_an_entry_has_room() {
    use leasehold::validate::{max_slot_metadata_bytes, slot_keepalive_bytes, MAX_SLOTS};
    const M: &str = "ConcurrencyLimitedStateMachine";
    let all = states(definition(M));
    let bind = &all["Bind"]["Choices"][0];
    assert_eq!((bind["Variable"].as_str(), bind["Next"].as_str()), (Some("$.config.slots"), Some("BindSlots")));
    let most = bind["NumericLessThanEquals"].as_u64().expect("a bound on the slots bound") as u32;
    assert_eq!(all["BindSlots"]["Parameters"], json!({"execution_arn.$": "$$.Execution.Id"}));
    assert_eq!(all["Unbound"]["Result"], Value::Null);
    for s in ["BindSlots", "Unbound"] {
        assert_eq!(all[s]["ResultPath"], "$.config.keepalive");
    }
    let request = &states(&all["ForEachItem"]["ItemProcessor"])["Request"]["Parameters"];
    assert_eq!(request["keepalive.$"], "$.config.keepalive");
    // The longest execution ARN: partition aws-us-gov, a Region of 14, the account, the name
    // template.yaml gives the state machine (concurrency-limited- and a UUID), a name of 80.
    let arn = format!(
        "arn:aws-us-gov:states:{}:{}:execution:concurrency-limited-{}:{}",
        "x".repeat(14),
        "1".repeat(12),
        "u".repeat(36),
        "n".repeat(80)
    );
    let keep = |n: u32| {
        max_slot_metadata_bytes(n)
            >= slot_keepalive_bytes(&leasehold::Keepalive { until_ms: 0, execution_arn: Some(arn.clone()) })
    };
    assert!(keep(most), "{most} slots: no room for the ARN");
    let first_without = (most..=MAX_SLOTS).find(|n| !keep(*n)).expect("room runs out below MAX_SLOTS");
    assert!(first_without > most && first_without - most < 64, "the bound {most} is far below {first_without}");
    let roles = &raw()["Resources"]["HeartbeatRole"]["Properties"]["Policies"].to_string();
    assert!(
        roles.contains("execution:${ConcurrencyLimitedStateMachine.Name}:*"),
        "DescribeExecution on its executions"
    );
    assert!(roles.contains(r#"{"Ref":"ConcurrencyLimitedStateMachine"}"#), "ListExecutions on it");
}

// ---- hardening ------------------------------------------------------------------------------

#[test]
fn waiting_acquires_cannot_exhaust_the_account_concurrency() {
    let t = raw();
    let p = &t["Resources"]["AcquireFunction"]["Properties"];
    assert_eq!(
        p["ReservedConcurrentExecutions"],
        json!({"Fn::If": ["ReserveAcquireConcurrency", {"Ref": "AcquireReservedConcurrency"}, {"Ref": "AWS::NoValue"}]})
    );
    assert_eq!(
        t["Conditions"]["ReserveAcquireConcurrency"],
        json!({"Fn::Not": [{"Fn::Equals": [{"Ref": "AcquireReservedConcurrency"}, 0]}]})
    );
    // Nothing reserved by default: Lambda refuses a reservation that leaves the account under
    // 100 unreserved executions, so a default deploy in a new account would fail.
    let reserved = t["Parameters"]["AcquireReservedConcurrency"]["Default"].as_u64().expect("a numeric default");
    assert_eq!(reserved, 0, "no reservation by default");
    let out = &transformed()["Resources"]["AcquireFunction"]["Properties"];
    assert!(out.get("ReservedConcurrentExecutions").is_some(), "a reservation, when set, reaches CloudFormation");
    // The trade-off is documented where the parameter is set, and throttles are alarmed on.
    let doc = t["Parameters"]["AcquireReservedConcurrency"]["Description"].as_str().unwrap();
    for needle in ["100 unreserved", "QueuedSingleFlight", "hot", "SingleFlight"] {
        assert!(doc.contains(needle), "the description says {needle:?}: {doc}");
    }
    let alarm = &t["Resources"]["AcquireThrottledAlarm"]["Properties"];
    assert_eq!((alarm["Namespace"].as_str(), alarm["MetricName"].as_str()), (Some("AWS/Lambda"), Some("Throttles")));
    assert_eq!(alarm["Dimensions"], json!([{"Name": "FunctionName", "Value": {"Ref": "AcquireFunction"}}]));
    assert_eq!(alarm["TreatMissingData"], "notBreaching");
}

#[test]
fn state_machines_survive_what_states_all_cannot_catch() {
    let t = raw();
    let acquire_timeout = t["Resources"]["AcquireFunction"]["Properties"]["Timeout"].as_u64().unwrap();
    for machine in MACHINES {
        let props = &t["Resources"][machine]["Properties"];
        assert_eq!(props["DefinitionSubstitutions"]["Partition"], json!({"Ref": "AWS::Partition"}), "{machine}");
        let text = statemachines::text(definition_name(machine));
        assert!(!text.contains("arn:aws:"), "{machine}: a hard-coded partition");
        let all = states(definition(machine));
        // The work's result is dropped (ResultPath null), so an odd one (a ResultSelector path
        // that is missing: States.Runtime) cannot skip the release. A result over 256 KiB
        // still fails the task before ResultPath applies (States.DataLimitExceeded, which no
        // Catch catches): the definition says so, and the lease is a keep-alive lease bound to
        // the execution by default, which the sweep frees however the execution ended.
        let work = &all["Work"];
        assert!(work["Comment"].as_str().is_some_and(|c| c.contains("256 KiB")), "{machine}: the cap is documented");
        assert!(!statemachines::text(definition_name(machine)).contains("however large"), "{machine}");
        let bound = all
            .values()
            .filter(|s| s["Type"] == "Pass")
            .any(|s| s["Parameters"]["keepalive"]["execution_arn.$"] == "$$.Execution.Id");
        assert!(bound, "{machine}: a keep-alive lease bound to the execution");
        assert_eq!(work["ResultPath"], Value::Null, "{machine}: Work has ResultPath null");
        assert!(work.as_object().unwrap().contains_key("ResultPath"), "{machine}: ResultPath: null, not absent");
        assert!(work.get("ResultSelector").is_none(), "{machine}");
        assert!(work.get("OutputPath").is_none(), "{machine}");
        // Every Lambda task retries the Lambda client's own timeout too, except the work: its
        // invocation may still run after those errors, and the lease is kept until it must
        // have ended instead (statemachines::rule; only a throttled invocation is retried).
        for (name, s) in all {
            if s["Type"] != "Task" {
                continue;
            }
            if name == "Work" {
                assert_eq!(s["Retry"][0]["ErrorEquals"], json!(["Lambda.TooManyRequestsException"]), "{machine}");
                continue;
            }
            let retries = s["Retry"].as_array().unwrap_or_else(|| panic!("{machine}.{name} retries"));
            let lambda_list = retries
                .iter()
                .find(|r| r["ErrorEquals"].to_string().contains("Lambda.ServiceException"))
                .unwrap_or_else(|| panic!("{machine}.{name} retries Lambda errors"));
            for e in [
                "Lambda.ServiceException",
                "Lambda.AWSLambdaException",
                "Lambda.SdkClientException",
                "Lambda.TooManyRequestsException",
                "Lambda.ClientExecutionTimeoutException",
            ] {
                assert!(lambda_list["ErrorEquals"].as_array().unwrap().contains(&json!(e)), "{machine}.{name}: {e}");
            }
        }
        // The acquire task waits at least as long as the function may run.
        let timeout = all["Acquire"]["TimeoutSeconds"].as_u64().expect("Acquire TimeoutSeconds");
        assert!(timeout >= acquire_timeout, "{machine}: Acquire TimeoutSeconds {timeout} < {acquire_timeout}");
    }
}

/// Evaluates the intrinsic functions an EventBridge Input may use here (`Fn::Sub` with a
/// variable map, `Fn::Base64`, `Ref` to a parameter) for the given parameter values.
fn evaluate(v: &Value, params: &serde_json::Map<String, Value>) -> String {
    if let Some(s) = v.as_str() {
        return s.to_string();
    }
    if let Some(name) = v.get("Ref").and_then(Value::as_str) {
        return params.get(name).and_then(Value::as_str).unwrap_or_else(|| panic!("no parameter {name}")).to_string();
    }
    if let Some(inner) = v.get("Fn::Base64") {
        return aws_smithy_types::base64::encode(evaluate(inner, params));
    }
    if let Some(sub) = v.get("Fn::Sub") {
        let (text, vars) = match sub {
            Value::String(s) => (s.as_str(), serde_json::Map::new()),
            Value::Array(a) => (a[0].as_str().unwrap(), a[1].as_object().unwrap().clone()),
            other => panic!("Fn::Sub {other}"),
        };
        let mut out = text.to_string();
        for (name, value) in &vars {
            out = out.replace(&format!("${{{name}}}"), &evaluate(value, params));
        }
        for (name, value) in params {
            out = out.replace(&format!("${{{name}}}"), value.as_str().unwrap());
        }
        assert!(!out.contains("${"), "unresolved: {out}");
        return out;
    }
    panic!("cannot evaluate {v}")
}

#[test]
fn the_scheduled_jobs_input_is_valid_json_for_any_key() {
    let events = &raw()["Resources"]["ScheduledJobStateMachine"]["Properties"]["Events"];
    let schedule = events.as_object().unwrap().values().find(|e| e["Type"] == "Schedule").expect("scheduled");
    for key in [r#"jobs/"quoted""#, r"jobs\back\slash", "jobs/scheduled-example", "jobs/ünïcødé", r#"{"key": 1}"#] {
        let params = json!({"ScheduledJobKey": key}).as_object().unwrap().clone();
        let input = evaluate(&schedule["Properties"]["Input"], &params);
        let v: Value =
            serde_json::from_str(&input).unwrap_or_else(|e| panic!("{key:?}: input {input} is not JSON: {e}"));
        let decoded = aws_smithy_types::base64::decode(v["key_base64"].as_str().expect("key_base64"));
        assert_eq!(String::from_utf8(decoded.unwrap()).unwrap(), key);
    }
    // The state machine decodes it before anything else.
    let all = states(definition("ScheduledJobStateMachine"));
    let start = &all[definition("ScheduledJobStateMachine")["StartAt"].as_str().unwrap()];
    assert_eq!(start["Choices"][0]["Variable"], "$.key_base64");
    let decode = &all[start["Choices"][0]["Next"].as_str().unwrap()];
    assert_eq!(decode["Parameters"]["key.$"], "States.Base64Decode($.key_base64)");
}

#[test]
fn sam_build_builds_the_architecture_sam_deploy_deploys() {
    // sam build reads parameter overrides from its own section or the global one, never from
    // [default.deploy.parameters]: the Architecture must be set where both read it.
    let text = std::fs::read_to_string(repo_root().join("samconfig.toml")).unwrap();
    let mut section = String::new();
    let mut global_arch = None;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
        } else if line.starts_with("parameter_overrides") {
            assert_eq!(section, "[default.global.parameters]", "parameter_overrides only in the global section");
            global_arch = line.split_whitespace().find_map(|w| w.trim_matches('"').strip_prefix("Architecture="));
        }
    }
    let arch = global_arch.expect("samconfig.toml sets Architecture for build and deploy");
    let allowed = &raw()["Parameters"]["Architecture"]["AllowedValues"];
    assert!(allowed.as_array().unwrap().contains(&json!(arch)), "{arch}");
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    assert!(readme.contains("Architecture=x86_64"), "the README says how to build for the other architecture");
}

// ---- observability -------------------------------------------------------------------------

/// The dashboard body with its `${...}` substitutions replaced, parsed.
fn dashboard_body() -> Value {
    let dashboards = resources_of(raw(), "AWS::CloudWatch::Dashboard");
    assert_eq!(dashboards.len(), 1, "one dashboard");
    let sub = dashboards[0].1["Properties"]["DashboardBody"]["Fn::Sub"].as_str().expect("a !Sub body");
    let mut text = String::new();
    let mut rest = sub;
    while let Some(i) = rest.find("${") {
        let end = rest[i..].find('}').expect("closed ${") + i;
        let name = &rest[i + 2..end];
        if name != "AWS::Region" {
            // Only an alarm's ARN, each named by the template.
            let alarm = name.strip_suffix(".Arn").unwrap_or_else(|| panic!("unexpected substitution ${{{name}}}"));
            assert_eq!(raw()["Resources"][alarm]["Type"], "AWS::CloudWatch::Alarm", "{name}");
        }
        text.push_str(&rest[..i]);
        text.push_str(&format!("SUB:{name}"));
        rest = &rest[end + 1..];
    }
    text.push_str(rest);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("the dashboard body is not JSON once substituted: {e}"))
}

/// The dimensions a metric is emitted with (shared/src/lambda/metrics.rs): Latency and Invocations by
/// Function and Outcome; the counts by Function or with none.
fn emitted_with(metric: &str, dims: &[(&str, &str)]) -> bool {
    use leasehold::lambda::{COUNT_METRICS, OUTCOME_METRICS};
    let names: Vec<&str> = dims.iter().map(|(n, _)| *n).collect();
    let functions = ["acquire", "heartbeat", "release"];
    let values_ok = dims.iter().all(|(n, v)| match *n {
        "Function" => functions.contains(v),
        "Outcome" => !v.is_empty(),
        _ => false,
    });
    values_ok
        && if OUTCOME_METRICS.contains(&metric) {
            names == ["Function", "Outcome"]
        } else {
            COUNT_METRICS.contains(&metric) && (names.is_empty() || names == ["Function"])
        }
}

#[test]
fn the_dashboard_reads_the_metrics_the_functions_emit() {
    use leasehold::lambda::{COUNT_METRICS, METRIC_NAMESPACE};
    let body = dashboard_body();
    let mut shown: BTreeSet<String> = BTreeSet::new();
    let mut stats: BTreeSet<String> = BTreeSet::new();
    let mut alarms_listed: BTreeSet<String> = BTreeSet::new();
    for w in body["widgets"].as_array().expect("widgets") {
        let p = &w["properties"];
        match w["type"].as_str() {
            Some("metric") => {
                assert_eq!(p["region"], "SUB:AWS::Region", "{w}");
                for m in p["metrics"].as_array().expect("metrics") {
                    let parts = m.as_array().unwrap();
                    let (opts, plain) = match parts.last() {
                        Some(Value::Object(o)) => (Some(o), &parts[..parts.len() - 1]),
                        _ => (None, &parts[..]),
                    };
                    let plain: Vec<&str> = plain.iter().map(|v| v.as_str().expect("a string")).collect();
                    assert_eq!(plain[0], METRIC_NAMESPACE, "{m}");
                    let dims: Vec<(&str, &str)> = plain[2..].chunks(2).map(|c| (c[0], c[1])).collect();
                    assert!(emitted_with(plain[1], &dims), "the functions never emit {m}");
                    shown.insert(plain[1].to_string());
                    let stat = opts.and_then(|o| o.get("stat")).or(p.get("stat")).and_then(Value::as_str);
                    let stat = stat.unwrap_or_else(|| panic!("{m} has a statistic"));
                    stats.insert(format!("{}:{stat}", plain[1]));
                }
            }
            Some("alarm") => {
                for a in p["alarms"].as_array().unwrap() {
                    alarms_listed
                        .insert(a.as_str().unwrap().trim_start_matches("SUB:").trim_end_matches(".Arn").into());
                }
            }
            other => panic!("unexpected widget type {other:?}"),
        }
    }
    // Every count is on the dashboard, with latency percentiles.
    for metric in COUNT_METRICS {
        assert!(shown.contains(metric), "{metric} is not on the dashboard");
    }
    for p in ["p50", "p90", "p99"] {
        assert!(stats.contains(&format!("Latency:{p}")), "latency {p}: {stats:?}");
    }
    // The alarm widget shows every alarm of the template.
    let alarms: BTreeSet<String> =
        resources_of(raw(), "AWS::CloudWatch::Alarm").into_iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(alarms_listed, alarms);
}

#[test]
fn alarms_watch_the_sweep_and_throttles_and_notify_the_optional_topic() {
    let t = raw();
    assert_eq!(t["Parameters"]["AlarmTopicArn"]["Default"], "");
    assert_eq!(t["Conditions"]["HasAlarmTopic"], json!({"Fn::Not": [{"Fn::Equals": [{"Ref": "AlarmTopicArn"}, ""]}]}));
    let alarms = resources_of(t, "AWS::CloudWatch::Alarm");
    let mut watched = BTreeSet::new();
    for (name, a) in &alarms {
        let p = &a["Properties"];
        if p["Namespace"] == "AWS/Lambda" || p["Namespace"] == "AWS/SQS" {
            // AWS's own metrics (AcquireThrottled, checked with the reservation; the history
            // pipeline's, checked with it).
            continue;
        }
        // A metric-math alarm: each of its metrics is one the functions emit.
        let metric_math = p["Metrics"].as_array().map(|ms| {
            ms.iter()
                .filter_map(|m| m.get("MetricStat"))
                .map(|st| {
                    let m = &st["Metric"];
                    assert_eq!(m["Namespace"], leasehold::lambda::METRIC_NAMESPACE, "{name}");
                    let dims: Vec<(&str, &str)> = as_list(&m["Dimensions"])
                        .iter()
                        .map(|d| (d["Name"].as_str().unwrap(), d["Value"].as_str().unwrap()))
                        .collect();
                    let metric = m["MetricName"].as_str().unwrap();
                    assert!(emitted_with(metric, &dims), "{name}: the functions never emit {metric} with {dims:?}");
                    metric.to_string()
                })
                .collect::<Vec<_>>()
        });
        let metric = match &metric_math {
            Some(metrics) => metrics.join("+"),
            None => {
                assert_eq!(p["Namespace"], leasehold::lambda::METRIC_NAMESPACE, "{name}");
                p["MetricName"].as_str().unwrap().to_string()
            }
        };
        let metric = metric.as_str();
        let dims: Vec<(&str, &str)> = as_list(&p["Dimensions"])
            .iter()
            .map(|d| (d["Name"].as_str().unwrap(), d["Value"].as_str().unwrap()))
            .collect();
        assert!(
            metric_math.is_some() || emitted_with(metric, &dims),
            "{name}: the functions never emit {metric} with {dims:?}"
        );
        assert_eq!(
            p["AlarmActions"],
            json!({"Fn::If": ["HasAlarmTopic", [{"Ref": "AlarmTopicArn"}], {"Ref": "AWS::NoValue"}]}),
            "{name} notifies the topic when one is given"
        );
        assert!(p["AlarmDescription"].as_str().is_some_and(|d| d.len() > 40), "{name} tells the operator what to do");
        watched.insert(format!("{metric}:{}", p["ComparisonOperator"].as_str().unwrap()));
        if metric == "Invocations" {
            // No sweep at all is the failure itself: a window without a sweep counts 0 (FILL)
            // once sweeps have reported in the evaluated range; before the first sweep of a new
            // stack the alarm stays INSUFFICIENT_DATA, and after a whole range without one it
            // keeps its state (ignore), instead of firing on a fresh deploy (breaching did).
            let ms = p["Metrics"].as_array().unwrap();
            let stat = ms.iter().find_map(|m| m.get("MetricStat")).unwrap();
            let sweep_dims: Vec<(&str, &str)> = as_list(&stat["Metric"]["Dimensions"])
                .iter()
                .map(|d| (d["Name"].as_str().unwrap(), d["Value"].as_str().unwrap()))
                .collect();
            assert_eq!(sweep_dims, [("Function", "heartbeat"), ("Outcome", "sweep")]);
            assert_eq!(stat["Stat"], "SampleCount");
            let id = ms.iter().find(|m| m.get("MetricStat").is_some()).unwrap()["Id"].as_str().unwrap();
            let shown: Vec<&Value> = ms.iter().filter(|m| m["ReturnData"] == true).collect();
            assert_eq!(shown.len(), 1, "{name}");
            assert_eq!(shown[0]["Expression"], format!("FILL({id}, 0)"), "{name}");
            assert_eq!(p["TreatMissingData"], "ignore", "{name}");
            assert_eq!(stat["Period"]["Fn::FindInMap"][1], json!({"Ref": "KeepaliveSweepPeriodMinutes"}));
            // M of N: one late EMF datapoint does not flap it.
            let (m, n) = (p["DatapointsToAlarm"].as_u64().unwrap_or(0), p["EvaluationPeriods"].as_u64().unwrap());
            assert!(m >= 2 && n > m, "{name}: {m} of {n}");
        } else {
            assert_eq!(p["TreatMissingData"], "notBreaching", "{name}");
        }
    }
    let want: BTreeSet<String> = [
        "SweepErrors+SweepDescribeFailures:GreaterThanOrEqualToThreshold",
        "SweepIncomplete:GreaterThanOrEqualToThreshold",
        "QueueSweepErrors:GreaterThanOrEqualToThreshold",
        "Invocations:LessThanThreshold",
        "Throttled:GreaterThanOrEqualToThreshold",
        "SweepReleased:GreaterThanOrEqualToThreshold",
        "ClockSkew:GreaterThanOrEqualToThreshold",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(watched, want);
    // "Sustained" throttling: every datapoint of 5 one-minute periods.
    let (_, throttled) = alarms.iter().find(|(_, a)| a["Properties"]["MetricName"] == "Throttled").unwrap();
    assert_eq!(
        (throttled["Properties"]["EvaluationPeriods"].as_u64(), throttled["Properties"]["DatapointsToAlarm"].as_u64()),
        (Some(5), Some(5))
    );
    // One "not running" period per sweep period the template allows: 3 sweep periods.
    let periods = t["Mappings"]["SweepPeriod"].as_object().unwrap();
    for (minutes, m) in periods {
        let s = t["Mappings"]["SweepAlarm"][minutes]["MissingPeriodS"].as_u64();
        assert_eq!(s, m["Ms"].as_u64().map(|ms| ms * 3 / 1000), "sweep period {minutes}");
    }
}

/// The state machines that continue as new executions of themselves (BatchProcessor,
/// ConcurrencyLimited) are named so that their policies can grant states:StartExecution on
/// exactly that state machine (no dependency cycle), by the stack id's UUID (a state machine's
/// name is at most 80 characters, a stack's 128: a name made of the stack name broke past 64).
#[test]
fn continuing_state_machines_are_named_by_the_stack_id() {
    let t = raw();
    for (machine, prefix) in
        [("BatchProcessorStateMachine", "batch-processor"), ("ConcurrencyLimitedStateMachine", "concurrency-limited")]
    {
        let p = &t["Resources"][machine]["Properties"];
        let uuid = json!({"StackUuid": {"Fn::Select": [2, {"Fn::Split": ["/", {"Ref": "AWS::StackId"}]}]}});
        assert_eq!(p["Name"], json!({"Fn::Sub": [format!("{prefix}-${{StackUuid}}"), uuid]}), "{machine}");
        // The longest name it can have: the prefix, a dash and a UUID.
        assert!(prefix.len() + 1 + 36 <= 80, "{machine}");
        let grants: Vec<&Value> = p["Policies"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["Statement"].as_array())
            .flatten()
            .filter(|st| st["Action"] == "states:StartExecution")
            .collect();
        assert_eq!(grants.len(), 1, "{machine}");
        let arn = format!(
            "arn:${{AWS::Partition}}:states:${{AWS::Region}}:${{AWS::AccountId}}:stateMachine:{prefix}-${{StackUuid}}"
        );
        assert_eq!(grants[0]["Resource"], json!({"Fn::Sub": [arn, uuid]}), "{machine}: StartExecution on itself only");
        // The ContinueAsNew task starts $$.StateMachine.Id, and takes ExecutionAlreadyExists
        // (a start whose answer was lost, retried after the execution ended) as done.
        let def = statemachines::parsed(definition_name(machine));
        let cont = &def["States"]["ContinueAsNew"];
        assert_eq!(cont["Resource"], "arn:${Partition}:states:::states:startExecution");
        assert_eq!(cont["Parameters"]["StateMachineArn.$"], "$$.StateMachine.Id");
        let exists = json!(["StepFunctions.ExecutionAlreadyExistsException"]);
        assert_eq!(cont["Retry"][0], json!({"ErrorEquals": exists, "MaxAttempts": 0}), "{machine}: not retried");
        let caught = cont["Catch"].as_array().unwrap().iter().find(|c| c["ErrorEquals"] == exists).expect("caught");
        let already = &def["States"][caught["Next"].as_str().unwrap()];
        assert!(already["Parameters"]["execution_arn.$"].as_str().unwrap().contains("$.next.name"), "{machine}");
    }
}

/// The BatchProcessor can continue as a new execution of itself, its ContinueAsNew task starts
/// `$$.StateMachine.Id` with the whole configuration, it may invoke the heartbeat function
/// (each iteration renews its lease), and every Lambda task retries Lambda's transient errors
/// (but the work, statemachines::rule).
#[test]
fn batch_processor_continues_as_itself_and_retries_lambda_errors() {
    let t = raw();
    let p = &t["Resources"]["BatchProcessorStateMachine"]["Properties"];
    let policies = p["Policies"].to_string();
    assert!(policies.contains("states:StartExecution"), "{policies}");
    assert!(policies.contains("\"HeartbeatFunction\""), "{policies}");
    let subs = &p["DefinitionSubstitutions"];
    assert_eq!(
        subs["HeartbeatFunctionArn"].to_string(),
        subs["AcquireFunctionArn"].to_string().replace("Acquire", "Heartbeat")
    );
    let def = statemachines::parsed("batch_processor");
    let all = def["States"].as_object().unwrap();
    let cont = &all["ContinueAsNew"];
    assert_eq!(cont["Resource"], "arn:${Partition}:states:::states:startExecution");
    assert_eq!(cont["Parameters"]["StateMachineArn.$"], "$$.StateMachine.Id");
    // Everything the configuration holds is carried over.
    let carried: BTreeSet<&str> = cont["Parameters"]["Input"]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.trim_end_matches(".$"))
        .filter(|k| !k.starts_with("AWS_"))
        .collect();
    let defaults: BTreeSet<&str> = all["Defaults"]["Parameters"]["defaults"]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.trim_end_matches(".$"))
        .collect();
    assert_eq!(carried, defaults);
    let iteration = all["ProcessBatch"]["ItemProcessor"]["States"].as_object().unwrap();
    for (name, s) in all.iter().chain(iteration.iter()) {
        if s["Type"] != "Task" || s["Resource"] != "arn:${Partition}:states:::lambda:invoke" {
            continue;
        }
        let retried: String = s["Retry"].to_string();
        let errors: &[&str] = if name == "Work" {
            &["Lambda.TooManyRequestsException"]
        } else {
            &["Lambda.ServiceException", "Lambda.AWSLambdaException", "Lambda.SdkClientException"]
        };
        for e in errors {
            assert!(retried.contains(e), "{name} retries {e}: {retried}");
        }
        if iteration.contains_key(name) {
            // Every task of an iteration is caught: one key cannot fail the execution.
            assert!(s["Catch"].to_string().contains("States.ALL"), "{name} is caught");
        }
    }
    assert_eq!(iteration["Renew"]["Parameters"]["FunctionName"], "${HeartbeatFunctionArn}");
    assert_eq!(all["ProcessBatch"]["ItemProcessor"]["StartAt"], "Renew");
}

/// `ClockSkew` lasts until a clock is fixed: a workflow that retries it does so in an entry of
/// its own, no sooner than the `Retry-After` the API gives it (issue 22: a hot retry loop on
/// `ClockSkew` sent 227,755 requests in 60 s).
#[test]
fn workflows_back_off_on_clock_skew() {
    fn walk(v: &Value, file: &str, seen: &mut u32) {
        match v {
            Value::Object(o) => {
                if let Some(Value::Array(retries)) = o.get("Retry") {
                    for r in retries {
                        let errors = r["ErrorEquals"].as_array().unwrap();
                        if errors.iter().any(|e| e == "ClockSkew") {
                            *seen += 1;
                            assert_eq!(errors.len(), 1, "{file}: ClockSkew shares a Retry entry: {r}");
                            let after = leasehold::CLOCK_SKEW_RETRY_AFTER.as_secs();
                            assert!(r["IntervalSeconds"].as_u64().unwrap_or(1) >= after, "{file}: {r}");
                        }
                    }
                }
                o.values().for_each(|v| walk(v, file, seen));
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, file, seen)),
            _ => {}
        }
    }
    let mut seen = 0;
    for (name, definition) in leasehold_tests::statemachines::all() {
        walk(&definition, &name, &mut seen);
    }
    assert!(seen > 0, "some workflow retries ClockSkew");
}
