#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Shell functions shared by hack/*.sh (sourced, never run). Callers set CACHE and `set -euo pipefail`.

# go_tools_build OUT MODULE VERSION PKG...
# Build the main packages PKG... of MODULE@VERSION from the Go module proxy into the directory OUT
# (one binary per package, named after its last path element), through a throwaway wrapper module:
# `go install MODULE/cmd/x@VERSION` fails here for modules with `replace` directives, and for others the
# proxy refuses the version list its deprecation check asks for; a `require` + tools.go + `go mod tidy`
# asks for neither. Built in a temporary directory under $CACHE and renamed at the end, so a build that
# fails half-way never looks finished. Static (CGO_ENABLED=0), stripped, no local paths (-trimpath).
go_tools_build() {
  local out=$1 module=$2 version=$3 tmp
  shift 3
  tmp=$(mktemp -d "$CACHE/.build-XXXXXX")
  mkdir -p "$tmp/mod" "$tmp/bin"
  if ! (
    cd "$tmp/mod"
    export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
    go mod init local/toolbuild >/dev/null 2>&1
    {
      printf '//go:build tools\n\npackage tools\n\nimport (\n'
      for p in "$@"; do printf '\t_ "%s"\n' "$p"; done
      printf ')\n'
    } >tools.go
    go mod edit -require "$module@$version"
    go mod tidy >&2
    go build -trimpath -ldflags "-s -w" -o "$tmp/bin/" "$@" >&2
  ); then
    rm -rf "$tmp"
    echo "go_tools_build: building $module@$version failed" >&2
    return 1
  fi
  rm -rf "$out"
  mv "$tmp/bin" "$out"
  rm -rf "$tmp"
}
