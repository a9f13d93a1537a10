#!/usr/bin/env python3
"""Prints template.yaml as JSON for the Rust tests (tests/tests/template.rs, workflows.rs).

    template_json.py raw TEMPLATE          the template as written: CloudFormation tags come
                                           out as intrinsic functions ({"Ref": ...},
                                           {"Fn::GetAtt": [...]}), decoded by cfn-lint
    template_json.py transformed TEMPLATE  the CloudFormation template the SAM transform
                                           makes of it (offline: CodeUri is replaced by a
                                           placeholder S3 location, and a state machine's
                                           local DefinitionUri (statemachines/*.asl.json)
                                           one under the same bucket, as `sam package` would)
    template_json.py create-only TYPE...   per resource type, the properties whose change
                                           replaces the resource (createOnlyProperties and
                                           conditionalCreateOnlyProperties of the CloudFormation
                                           registry schema cfn-lint ships, us-east-1), as
                                           JSON pointers ("/properties/TableName")

Runs with the Python of the tools venv (.tools/venv/bin/python), which has cfn-lint and
the SAM translator.
"""

import json
import os
import sys

from cfnlint.decode import decode


def load(path):
    template, matches = decode(path)
    if matches:
        for m in matches:
            print(m, file=sys.stderr)
        sys.exit(2)
    return template


def transformed(template):
    from samtranslator.translator.transform import transform

    class Policies:
        # The translator asks IAM for managed policy ARNs only when a template names one by
        # its short name; answering locally keeps this offline.
        def load(self):
            return {}

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    for resource in template.get("Resources", {}).values():
        if resource.get("Type") == "AWS::Serverless::Function":
            resource.setdefault("Properties", {})["CodeUri"] = "s3://leasehold-artifacts/code.zip"
        if resource.get("Type") == "AWS::Serverless::StateMachine":
            props = resource.setdefault("Properties", {})
            if "DefinitionUri" in props:
                props["DefinitionUri"] = "s3://leasehold-artifacts/" + props["DefinitionUri"]
    return transform(template, {}, Policies())


def create_only(types):
    from cfnlint.schema.manager import PROVIDER_SCHEMA_MANAGER

    out = {}
    for t in types:
        schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema("us-east-1", t).schema
        paths = schema.get("createOnlyProperties", []) + schema.get("conditionalCreateOnlyProperties", [])
        out[t] = sorted(set(paths))
    return out


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "create-only":
        json.dump(create_only(sys.argv[2:]), sys.stdout, indent=1, sort_keys=True)
        print()
        return
    if len(sys.argv) != 3 or sys.argv[1] not in ("raw", "transformed"):
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    template = load(sys.argv[2])
    if sys.argv[1] == "transformed":
        template = transformed(template)
    json.dump(template, sys.stdout, indent=1, sort_keys=True, default=str)
    print()


if __name__ == "__main__":
    main()
