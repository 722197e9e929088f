package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// clockTicks is the unit of /proc's CPU times (USER_HZ, 100 on Linux).
const clockTicks = 100

// cpuOf is the CPU time, in microseconds, that the process pid has used so
// far (user and system), or 0 when /proc cannot tell (not Linux).
func cpuOf(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// The command name, in parentheses, may hold spaces: fields count from
	// after its closing one. utime and stime are fields 14 and 15.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	user, _ := strconv.ParseInt(f[11], 10, 64)
	sys, _ := strconv.ParseInt(f[12], 10, 64)
	return (user + sys) * 1e6 / clockTicks
}

// cpuOfServer is the CPU time, in microseconds, that the running processes
// named comm (a store's server: "postgres", "redis-server") whose command
// line holds arg (its address, to tell one Redis from another; "" for any)
// have used so far. Processes that exit between two readings take their
// time with them, which the servers measured here do not do under load.
func cpuOfServer(comm, arg string) int64 {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var total int64
	for _, d := range dirs {
		name, err := os.ReadFile(filepath.Join(d, "comm"))
		if err != nil || strings.TrimSpace(string(name)) != comm {
			continue
		}
		if cmdline, err := os.ReadFile(filepath.Join(d, "cmdline")); err != nil || !strings.Contains(string(cmdline), arg) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(d))
		total += cpuOf(pid)
	}
	return total
}
