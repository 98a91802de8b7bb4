#!/usr/bin/env bash
# passes when greet.sh greets its first argument
[ "$(bash greet.sh Ada)" = "Hello, Ada!" ] && [ "$(bash greet.sh "Grace Hopper")" = "Hello, Grace Hopper!" ]
