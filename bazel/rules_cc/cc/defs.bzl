"""The native C++ rules under the names @rules_cc//cc:defs.bzl gives them.

Bazel 4.2's own tools (@bazel_tools//tools/cpp) load these names from
@rules_cc, which Bazel would download; the rules themselves are built in.
This keeps the build offline (Debian's bazel-rules-cc 0.0.4 is too new for
Bazel 4.2: it needs `use_cpp_toolchain`).
"""

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)
