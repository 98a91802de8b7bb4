#!/usr/bin/env bash
# passes when hello.txt holds exactly the line "hello world"
[ "$(cat hello.txt 2>/dev/null)" = "hello world" ]
