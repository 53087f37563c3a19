#!/bin/sh
echo "coverage is not set up in this Bazel build (bazel/no_coverage_tools)" >&2
exit 1
