#!/usr/bin/env bash
# passes when sum.txt holds the sum of numbers.txt (1251)
[ "$(tr -d "[:space:]" < sum.txt 2>/dev/null)" = "1251" ]
