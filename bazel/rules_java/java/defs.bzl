"""The native Java rules under the names @rules_java//java:defs.bzl gives them.

Bazel 4.2's own tools (@bazel_tools//tools/jdk, whose toolchains every
build registers) load these names from @rules_java, which Bazel would
download; the rules are built in. Nothing here builds Java.
"""

def java_binary(**kwargs):
    native.java_binary(**kwargs)

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_library(**kwargs):
    native.java_library(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
