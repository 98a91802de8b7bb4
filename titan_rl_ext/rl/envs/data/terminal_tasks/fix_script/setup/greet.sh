#!/usr/bin/env bash
echo "Hello, $2!"
