package storeopen

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"

	"github.com/aws/smithy-go/logging"
	"github.com/redis/go-redis/v9"
)

// driverLogger receives what the drivers log by themselves; see SetLogger.
var driverLogger atomic.Pointer[slog.Logger]

// SetLogger sends what the store drivers log by themselves to log, so that
// a JSON log holds only JSON lines: go-redis's lines (its logger is the
// process's) and the AWS SDK's (for the stores opened after the call).
func SetLogger(log *slog.Logger) {
	driverLogger.Store(log)
	redis.SetLogger(driverLog{log.With("driver", "go-redis")})
}

type driverLog struct{ log *slog.Logger }

// Printf is go-redis's logging interface.
func (d driverLog) Printf(ctx context.Context, format string, v ...any) {
	d.log.WarnContext(ctx, strings.TrimSpace(fmt.Sprintf(format, v...)))
}

// Logf is the AWS SDK's logging interface.
func (d driverLog) Logf(c logging.Classification, format string, v ...any) {
	level := slog.LevelWarn
	if c == logging.Debug {
		level = slog.LevelDebug
	}
	d.log.Log(context.Background(), level, strings.TrimSpace(fmt.Sprintf(format, v...)))
}

// awsLogger is the AWS SDK's logger for a store opened now.
func awsLogger() logging.Logger {
	log := driverLogger.Load()
	if log == nil {
		log = slog.Default()
	}
	return driverLog{log.With("driver", "aws-sdk-go-v2")}
}
