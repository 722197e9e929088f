package storeopen

import (
	"context"
	"fmt"
	"log/slog"
	"strings"

	"github.com/redis/go-redis/v9"
)

// SetLogger sends what the store drivers log by themselves to log, so that
// a JSON log holds only JSON lines. (go-redis logs through a logger of its
// own, shared by the process.)
func SetLogger(log *slog.Logger) {
	redis.SetLogger(driverLog{log.With("driver", "go-redis")})
}

type driverLog struct{ log *slog.Logger }

func (d driverLog) Printf(ctx context.Context, format string, v ...any) {
	d.log.WarnContext(ctx, strings.TrimSpace(fmt.Sprintf(format, v...)))
}
